"""Several models in one deployment (MODELS): the setting, `unknown_model` on every route that takes a model,
GET /v1/models, /readyz and /metrics per model, and workers that claim only their own model's jobs and
batches. On PostgreSQL, with the workers' pass loops in-process: `small` is the tiny random model with the
bundled tokenizer, `judge` a tiny Llama checkpoint with a word-level tokenizer of its own and 64 token ids
(so the same text is other ids, and a label id valid for `small` is out of range for `judge`)."""

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from core import Scorer
from store import claims, finishing, sweeper
from store.db import session_scope
from store.models import Batch, Job, Pass, utcnow
from store.settings import Settings, get_settings
from tests import claiming
from tests.load_runner import SCORE_RTOL
from worker import drain as drain_module

JUDGE_WORDS = ["[UNK]", "yes", "no", "the", "cat", "dog", "is", "a", "question", "answer", "good", "bad", "?", ":"]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def build_judge(path: Path) -> None:
    """A tiny random Llama checkpoint with a word-level tokenizer (ids differ from the bundled tokenizer's)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(JUDGE_WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).eval().save_pretrained(path)


# ---- the setting -----------------------------------------------------------------------------------------------

def test_models_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODEL", raising=False)
    monkeypatch.setenv("MODELS", " small=smollm2-135m , judge=/models/qwen3-reranker,tiny-random")
    settings = Settings(_env_file=None)
    assert settings.served_models == {"small": "smollm2-135m", "judge": "/models/qwen3-reranker",
                                      "tiny-random": "tiny-random"}
    assert settings.default_model == "small" and settings.worker_model == "small"  # MODEL unset: the first
    assert Settings(_env_file=None, model="judge").worker_model == "judge"
    with pytest.raises(ValueError, match="not a name of MODELS"):
        Settings(_env_file=None, model="/models/qwen3-reranker").worker_model  # a source is not a name
    monkeypatch.setenv("MODELS", '{"a": "tiny-random", "b": "smollm2-135m"}')
    assert list(Settings(_env_file=None).served_models) == ["a", "b"]
    for bad in ("a=tiny-random,a=smollm2-135m", "=tiny-random", "a=", "x" * 101 + "=tiny-random"):
        monkeypatch.setenv("MODELS", bad)
        with pytest.raises(ValueError):
            Settings(_env_file=None)
    # MODEL alone: the single-model shorthand, named as its source.
    monkeypatch.delenv("MODELS")
    monkeypatch.setenv("MODEL", "tiny-random")
    settings = Settings(_env_file=None)
    assert settings.served_models == {"tiny-random": "tiny-random"} and settings.worker_model == "tiny-random"
    monkeypatch.delenv("MODEL")
    assert Settings(_env_file=None).served_models == {"smollm2-135m": "smollm2-135m"}


# ---- one model (the suite's app: MODEL=tiny-random) --------------------------------------------------------------

BODY = {"query": "Is it good?", "items": [" yes", " no"], "label_token_ids": [5, 17]}


def test_unknown_model_is_400_on_every_route(client, make_key, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    headers = auth(key)
    rerank = {"query": "q", "documents": ["a", "b"]}
    refused = [
        client.post("/jobs", json={**BODY, "model": "nope"}, headers=headers),
        client.post("/jobs", json={**rerank, "kind": "rerank", "model": "nope"}, headers=headers),
        client.post("/v1/score", json={**BODY, "model": "nope"}, headers=headers),
        client.post("/v1/rerank", json={**rerank, "model": "nope"}, headers=headers),
        client.post("/batches?model=nope", content=json.dumps({"custom_id": "a", **BODY}).encode(),
                    headers={**headers, "content-type": "application/jsonl"}),
        client.post("/batches", json={"requests": [{"custom_id": "a", **BODY}], "model": "nope"}, headers=headers),
        client.post("/batches", json={"input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "out"),
                                      "model": "nope"}, headers=headers),
    ]
    for response in refused:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "unknown_model", response.text
        assert "'tiny-random'" in response.json()["error"]["message"]  # says what is served
    # Named as served, or not named: accepted.
    assert client.post("/jobs", json={**BODY, "model": "tiny-random"}, headers=headers).status_code == 202
    assert client.post("/jobs", json=BODY, headers=headers).json()["model"] == "tiny-random"
    # A batch line naming an unknown model is a failed line of its own.
    lines = [{"custom_id": "good", **BODY}, {"custom_id": "bad", **BODY, "model": "nope"}]
    batch = client.post("/batches", json={"requests": lines}, headers=headers).json()
    assert batch["counts"]["failed"] == 1 and batch["model"] == "tiny-random"
    results = client.get(f"/batches/{batch['id']}/results", headers=headers).text.splitlines()
    assert [json.loads(line)["error"]["code"] for line in results] == ["unknown_model"]


def test_v1_models_lists_each_model_with_its_live_workers(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    assert client.get("/v1/models").status_code == 401
    settings = get_settings()
    drain_module.heartbeat("models-w1", "tiny-random", settings, "xla", "ready")
    drain_module.heartbeat("models-w2", "tiny-random", settings, "xla", "warming")
    drain_module.heartbeat("models-other", "gone-model", settings, "xla", "ready")  # not configured: not listed
    answer = client.get("/v1/models", headers=auth(key)).json()
    created = answer["data"][0].pop("created")
    assert isinstance(created, int) and created > 0
    assert answer == {"object": "list", "data": [{"id": "tiny-random", "object": "model", "owned_by": "packscore",
                                                  "default": True, "workers": {"ready": 1, "warming": 1}}]}


# ---- two models -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_models(database: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """An API serving MODELS=small=tiny-random,judge=<the tiny judge>, and the two workers' engines and
    settings (MODEL=small, MODEL=judge)."""
    from api.deps import get_models
    from api.main import create_app

    path = tmp_path_factory.mktemp("judge")
    build_judge(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MODELS", f"small=tiny-random,judge={path}")
        get_settings.cache_clear()
        get_models.cache_clear()
        try:
            with TestClient(create_app()) as client:
                yield {"client": client, "path": path,
                       "small": (Scorer.from_pretrained("tiny-random", name="small", pass_tokens=512),
                                 Settings(model="small")),
                       "judge": (Scorer.from_pretrained(str(path), name="judge", pass_tokens=512),
                                 Settings(model="judge"))}
        finally:
            get_settings.cache_clear()
            get_models.cache_clear()


def _submit(client: TestClient, key: str, body: dict) -> dict:
    response = client.post("/jobs", json=body, headers=auth(key))
    assert response.status_code == 202, response.text
    return response.json()


def _row(job_id: str) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def test_each_model_tokenizes_with_its_own_tokenizer_and_limits(two_models, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    client, (key, _) = two_models["client"], make_key()
    body = {"query": "the cat is good", "items": [" yes", " no dog"], "label_token_ids": [1, 2]}
    default = _submit(client, key, body)
    judged = _submit(client, key, {**body, "model": "judge"})
    assert default["model"] == "small" and judged["model"] == "judge"  # no model: the first of MODELS
    assert _row(default["id"]).tokens != _row(judged["id"]).tokens
    assert _row(judged["id"]).tokens == two_models["judge"][0].tokenize(
        body["query"], body["items"], body["label_token_ids"]).to_bytes()
    # Token id 300 is in small's vocabulary (49,152 ids), not in judge's (64).
    assert client.post("/jobs", json={**body, "label_token_ids": [300]}, headers=auth(key)).status_code == 202
    refused = client.post("/jobs", json={**body, "label_token_ids": [300], "model": "judge"}, headers=auth(key))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "label_token_id_out_of_range"
    # The model's rerank prompt: its labels' ids in its own tokenizer.
    rerank = _submit(client, key, {"kind": "rerank", "model": "judge", "query": "a question",
                                   "documents": ["the cat", "a dog"]})
    assert _row(rerank["id"]).request["label_token_ids"] == [1, 2]  # " yes", " no" in judge's tokenizer
    assert client.post("/v1/score", json={**body, "model": "tiny-random"},  # a source is not a name
                       headers=auth(key)).json()["error"]["code"] == "unknown_model"


def test_a_job_of_a_model_with_no_live_worker_waits_in_the_queue(two_models, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    client, (key, _) = two_models["client"], make_key()
    scorer, settings = two_models["small"]
    drain_module.heartbeat("small-worker", "small", settings, "xla", "ready")
    job = _submit(client, key, {"query": "the cat", "items": [" yes"], "label_token_ids": [1], "model": "judge"})
    with session_scope() as session:  # older than a sweep interval: a lost kick, were it small's
        session.execute(update(Job).values(created_at=utcnow() - timedelta(seconds=60)))
    assert drain_module.drain(scorer, "small-worker", settings) == 0
    assert sweeper.sweep(settings) is False  # small's workers do not keep waking for judge's jobs
    assert _row(job["id"]).status == "queued"
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text  # small is served
    assert ready.json()["models"] == {"small": {"workers": 1, "warming": 0, "jobs_waiting": False},
                                      "judge": {"workers": 0, "warming": 0, "jobs_waiting": True}}
    listed = {m["id"]: m["workers"] for m in client.get("/v1/models", headers=auth(key)).json()["data"]}
    assert listed == {"small": {"ready": 1, "warming": 0}, "judge": {"ready": 0, "warming": 0}}
    metrics = client.get("/metrics").text
    for line in ('packscore_model_queue_depth{lane="interactive",model="judge"} 1.0',
                 'packscore_model_queue_depth{lane="interactive",model="small"} 0.0',
                 'packscore_model_workers{model="small"} 1.0', 'packscore_model_workers{model="judge"} 0.0'):
        assert line in metrics, metrics
    # Its worker starts: the job runs.
    judge, judge_settings = two_models["judge"]
    assert sweeper.sweep(judge_settings) is True
    assert drain_module.drain(judge, "judge-worker", judge_settings) == 1
    assert _row(job["id"]).status == "succeeded"


def test_two_workers_each_claim_only_their_models_jobs_and_batches(two_models, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    client, (key, _) = two_models["client"], make_key()
    bodies = {model: [{"query": f"the {w} is good ?", "items": [" yes", " a dog", ""], "label_token_ids": [1, 2],
                       "model": model} for w in ("cat", "dog", "question")] for model in ("small", "judge")}
    ids = {model: [_submit(client, key, body)["id"] for body in bodies[model]] for model in bodies}
    # A batch for judge: its lines name it; one naming small fails (a batch runs one model).
    lines = [{"custom_id": f"l{i}", **body} for i, body in enumerate(bodies["judge"])]
    lines.append({"custom_id": "other", **bodies["small"][0]})
    batch = client.post("/batches", content="\n".join(map(json.dumps, lines)).encode(),
                        headers={**auth(key), "content-type": "application/jsonl"}).json()
    assert batch["model"] == "judge" and batch["counts"]["failed"] == 1
    # Interactive before batch holds within a model's queue: small's queued jobs do not hold judge's batch back.
    judge, judge_settings = two_models["judge"]
    first = claiming.claim_jobs("judge-worker", judge_settings)
    assert {job.model for job in first} == {"judge"} and {job.id for job in first} == set(ids["judge"])
    finishing.release("judge-worker", judge_settings, [job.id for job in first], None)
    assert {job.batch_id for job in claims.claim_batch_round("judge-worker", judge_settings, 10_000)} == \
        {batch["id"]}
    with session_scope() as session:
        session.execute(update(Job).where(Job.lease_owner == "judge-worker")
                        .values(status="queued", lease_owner=None, lease_expires_at=None))

    small, small_settings = two_models["small"]
    assert drain_module.drain(small, "small-worker", small_settings) == 3
    with session_scope() as session:
        by_status = {(m, s) for m, s in session.execute(select(Job.model, Job.status).where(Job.status != "failed"))}
        assert by_status == {("small", "succeeded"), ("judge", "queued")}
    assert drain_module.drain(judge, "judge-worker", judge_settings) == 6  # 3 jobs, 3 batch lines
    with session_scope() as session:
        assert {(m, s) for m, s in session.execute(select(Job.model, Job.status))} == \
            {("small", "succeeded"), ("judge", "succeeded"), ("judge", "failed")}
        assert session.scalar(select(Batch.status).where(Batch.id == batch["id"])) == "completed"
        assert set(session.scalars(select(Pass.worker))) == {"small-worker", "judge-worker"}
    # Each job was scored by its own model.
    for model, scorer in (("small", small), ("judge", judge)):
        for job_id, body in zip(ids[model], bodies[model]):
            job = client.get(f"/jobs/{job_id}", headers=auth(key)).json()
            expected = scorer.score(body["query"], body["items"], body["label_token_ids"])
            np.testing.assert_allclose(job["scores"], expected, rtol=SCORE_RTOL, atol=0)


# ---- two live worker processes ---------------------------------------------------------------------------------

def test_two_worker_processes_serve_two_models(redis_url: str, run_id: str, database_factory,  # type: ignore[no-untyped-def]
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    """`packscore serve` with MODELS=small,judge and real Celery workers (MODEL=small, later MODEL=judge), each on
    its model's broker queue: a judge job waits while only small's worker runs, and runs once judge's starts."""
    from tests.service_harness import running_service, wait_terminal, wait_until

    path = tmp_path_factory.mktemp("judge-live")
    build_judge(path)
    references = {"small": Scorer.from_pretrained("tiny-random", name="small"),
                  "judge": Scorer.from_pretrained(str(path), name="judge")}
    bodies = {model: [{"query": f"the {w} is good ?", "items": [" yes", " a dog", ""], "label_token_ids": [1, 2],
                       "model": model} for w in ("cat", "dog")] for model in references}
    with database_factory(f"packscore_models_{run_id}") as url:
        env = {"DATABASE_URL": url, "BROKER_KEY_PREFIX": f"packscore_test_{run_id}:models:",
               "MODELS": f"small=tiny-random,judge={path}"}
        with running_service(env, tmp_path_factory.mktemp("models-logs")) as service, service.http() as http:
            service.start_worker(env={"MODEL": "small"})
            wait_until(lambda: http.get("/v1/models").json()["data"][0]["workers"]["ready"] == 1, 300,
                       "small's worker")
            ids = {model: [http.post("/jobs", json=body).json()["id"] for body in bodies[model]] for model in bodies}
            done = wait_terminal(http, ids["small"])
            time.sleep(3)  # several of small's idle rounds: judge's jobs must still be waiting
            assert {http.get(f"/jobs/{i}").json()["status"] for i in ids["judge"]} == {"queued"}
            assert {m["id"]: m["workers"]["ready"] for m in http.get("/v1/models").json()["data"]} == \
                {"small": 1, "judge": 0}

            service.start_worker(env={"MODEL": "judge"})
            done.update(wait_terminal(http, ids["judge"], seconds=300))
            assert {m["id"]: m["workers"]["ready"] for m in http.get("/v1/models").json()["data"]} == \
                {"small": 1, "judge": 1}
            for model, reference in references.items():
                for job_id, body in zip(ids[model], bodies[model]):
                    job = done[job_id]
                    assert job["status"] == "succeeded" and job["model"] == model, job
                    expected = reference.score(body["query"], body["items"], body["label_token_ids"])
                    np.testing.assert_allclose(job["scores"], expected, rtol=SCORE_RTOL, atol=0)

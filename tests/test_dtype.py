"""The engine's dtype (core/dtype.py): DTYPE=auto by the host's CPU features (faked both ways), XLA's flags per
dtype and feature, the warm-up's bfloat16 rule (a real model that breaks it falls back to float32),
`packscore check`'s bfloat16 advice, and one dtype per model across a deployment (store.workers.register)."""

import json
import logging
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import update

from core import dtype as dtypes
from core.check import ModelCheck, Report, _bfloat16_advice
from core.config import TINY_CONFIG
from core.requests import ModelSource
from core.scorer import Scorer
from core.weights import random_weights
from store import workers
from store.db import session_scope
from store.models import Worker, utcnow
from store.settings import get_settings

AMX = ["amx_bf16", "avx512_bf16", "avx512f"]
AVX2 = []  # cpu_flags() lists only the features the choice reads: an AVX2 host has none of them


def test_auto_is_bfloat16_on_amx_cpus_and_accelerators_float32_on_other_cpus() -> None:
    assert dtypes.resolve("auto", "cpu", AMX) == "bfloat16"
    assert dtypes.resolve("auto", "cpu", ["avx512_bf16", "avx512f"]) == "float32"
    assert dtypes.resolve("auto", "cpu", AVX2) == "float32"
    assert dtypes.resolve("auto", "tpu", AVX2) == dtypes.resolve("auto", "gpu", AVX2) == "bfloat16"
    for setting in dtypes.DTYPES:  # a dtype named is kept, whatever the host
        assert dtypes.resolve(setting, "cpu", AMX) == dtypes.resolve(setting, "tpu", AVX2) == setting


def test_cpu_flags_reads_the_features_of_cpuinfo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert dtypes.cpu_flags(str(cpuinfo)) == AMX
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n")
    assert dtypes.cpu_flags(str(cpuinfo)) == []
    assert dtypes.cpu_flags(str(tmp_path / "missing")) == []


@pytest.mark.parametrize("flags, expected", [(AMX, "bfloat16"), (AVX2, "float32")])
def test_a_scorer_set_to_auto_follows_the_cpu(monkeypatch, flags, expected) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: flags)
    scorer = Scorer(TINY_CONFIG, random_weights(TINY_CONFIG), ModelSource.resolve("tiny-random").tokenizer(),
                    name="tiny", dtype="auto")
    assert scorer.dtype.name == expected


def test_xla_flags_come_from_one_table_by_dtype_and_cpu_feature() -> None:
    ynn = f"{dtypes.YNN_FUSION}=dot,eltwise,reduce"
    for flags in (AMX, ["avx512_bf16"], AVX2):
        assert dtypes.xla_cpu_flags("float32", flags) == (ynn,)  # YNNPACK's fusions for float32
        assert dtypes.xla_cpu_flags("bfloat16", flags) == ()  # XLA's own path, which reaches AVX512-BF16/AMX
    assert dtypes.xla_cpu_flags("auto", AMX) == () and dtypes.xla_cpu_flags("auto", AVX2) == (ynn,)


def _loader(scale: float):  # type: ignore[no-untyped-def]
    """The tiny model with its final norm's weights multiplied by `scale` (its logits grow with it)."""
    weights = random_weights(TINY_CONFIG, seed=0)
    weights["final_norm"]["weight"] = weights["final_norm"]["weight"] * scale
    tokenizer = ModelSource.resolve("tiny-random").tokenizer()
    return lambda dtype: Scorer(TINY_CONFIG, weights, tokenizer, name="tiny", dtype=dtype)


def test_warm_up_falls_back_to_float32_for_a_model_that_breaks_the_bfloat16_rule(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, "core.dtype")
    kept = _loader(1.0)  # logits of a realistic range: bfloat16 lands about 0.01 from float32
    assert dtypes.checked_bfloat16(kept("bfloat16"), kept, "tiny").dtype.name == "bfloat16"
    # Logits 20x larger: bfloat16's rounding of the weights moves the log-probs about 0.2, past the bound.
    broken = _loader(20.0)
    served = dtypes.checked_bfloat16(broken("bfloat16"), broken, "tiny")
    assert served.dtype.name == "float32"
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    distance = float(warning.split("bfloat16 is ")[1].split()[0])
    assert distance > dtypes.BF16_TOLERANCE and "serving float32 instead" in warning, warning
    float32 = broken("float32")
    assert dtypes.checked_bfloat16(float32, broken, "tiny") is float32  # float32 is served as it is


def test_check_recommends_a_dtype_from_the_speed_and_the_distance() -> None:
    report = Report()
    model = ModelCheck("tiny", "tiny-random", dtype="bfloat16")
    reference = np.zeros((2, 4))
    _bfloat16_advice(report, "model tiny", model, (10, 2, 5), 0, reference, 0.01, 0.145)
    _bfloat16_advice(report, "model tiny", model, (10, 2, 5), 0, reference, 0.5, 0.145)
    within, broken = report.findings
    assert within.data["matmul_gflops"]["float32"] > 0 and within.data["matmul_gflops"]["bfloat16"] > 0
    assert within.data["recommended"] == ("bfloat16" if within.data["speedup"] >= 1.5 else "float32")
    assert "bfloat16 on this host" in within.text and f"DTYPE={within.data['recommended']} recommended" in within.text
    assert broken.data["recommended"] == "float32" and "broken" in broken.text


def test_a_model_is_served_in_one_dtype_across_its_workers(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    settings = get_settings()
    workers.register("dtype-w1", "tiny-random", "float32", settings)
    workers.register("dtype-w2", "tiny-random", "float32", settings)  # the same dtype: welcome
    workers.register("dtype-other", "other-model", "bfloat16", settings)  # another model: its own dtype
    with pytest.raises(workers.DtypeMismatch, match="this worker computes in bfloat16 but the model's live "
                                                    "workers do not \\(2 in float32\\)"):
        workers.register("dtype-w3", "tiny-random", "bfloat16", settings)
    key, _ = make_key()
    listed = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    assert [(m["id"], m["dtype"]) for m in listed] == [("tiny-random", "float32")]
    # Once the float32 workers are gone (not seen for WORKER_STALE_SECONDS), a bfloat16 one may serve the model.
    with session_scope() as session:
        session.execute(update(Worker).values(last_seen_at=utcnow() - timedelta(seconds=600)))
    workers.register("dtype-w3", "tiny-random", "bfloat16", settings)


def test_every_result_says_the_dtype_it_was_computed_in(client, make_key, empty_queue) -> None:  # type: ignore[no-untyped-def]
    from store.models import Job
    from store.schemas import route_body
    from worker import drain as drain_module

    settings = get_settings()
    headers = {"Authorization": f"Bearer {make_key()[0]}"}
    body = {"query": "Is it good?", "items": [" yes", " no"], "label_token_ids": [5, 17]}
    job = client.post("/jobs", json=body, headers=headers).json()
    assert job["dtype"] is None  # not computed yet
    batch = client.post("/batches", json={"requests": [{"custom_id": "a", **body}]}, headers=headers).json()
    workers.register("dtype-scorer", "tiny-random", "float32", settings)
    scorer = Scorer.from_pretrained("tiny-random", name="tiny-random", dtype="float32")
    assert drain_module.drain(scorer, "dtype-scorer", settings) == 2
    assert client.get(f"/jobs/{job['id']}", headers=headers).json()["dtype"] == "float32"
    with session_scope() as session:
        row = session.get(Job, job["id"])
        assert route_body(row, np.zeros((2, 2))).dtype == "float32"  # /v1/score's answer
    native = client.get(f"/batches/{batch['id']}/results", headers=headers).text.splitlines()
    assert [line["dtype"] for line in map(json.loads, native)] == ["float32"]
    openai = client.get(f"/batches/{batch['id']}/results", params={"format": "openai"}, headers=headers)
    assert json.loads(openai.text)["response"]["body"]["dtype"] == "float32"


def test_a_subprocess_of_another_dtype_drops_its_parents_table_flags() -> None:
    ynn = f"{dtypes.YNN_FUSION}=dot,eltwise,reduce"
    assert dtypes.without_table_flags(f"--xla_force_host_platform_device_count=4 {ynn}") == \
        "--xla_force_host_platform_device_count=4"

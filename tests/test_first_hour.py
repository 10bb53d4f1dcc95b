"""A new user's first hour (issue 22): errors a person can act on, /docs offline, the CLI's key lookup."""

import pytest

from tests.test_api_jobs import assert_error, auth

GOOD = {"query": "Is the city in France? Answer yes or no.", "items": ["\nCity: Lyon\nAnswer:"],
        "label_token_ids": [9805, 787]}


def test_malformed_json_names_line_and_column(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    body = b'{\n  "query": "q",\n  "items": ["a",]\n}'
    response = client.post("/jobs", content=body, headers={**auth(key), "content-type": "application/json"})
    assert_error(response, 422, "invalid_input")
    message = response.json()["error"]["message"]
    assert "line 3, column 17" in message and "not valid JSON" in message, message


def test_a_body_without_a_json_content_type_is_named(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    import json

    for headers, named in (({}, "no content-type"), ({"content-type": "text/plain"}, "'text/plain'")):
        response = client.post("/v1/score", content=json.dumps(GOOD), headers={**auth(key), **headers})
        assert_error(response, 415, "unsupported_media_type")
        message = response.json()["error"]["message"]
        assert "application/json" in message and named in message, message
    # The same body with the right content-type is fine (the content-type, not the body, was wrong).
    response = client.post("/jobs", content=json.dumps(GOOD), headers={**auth(key), "content-type": "application/json"})
    assert response.status_code == 202, response.text


def test_a_private_webhook_address_refusal_names_the_allowlist(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    response = client.post("/jobs", json={**GOOD, "webhook_url": "http://10.1.2.3:9/hook"}, headers=auth(key))
    assert_error(response, 400, "invalid_webhook_url")
    assert "WEBHOOK_ALLOWLIST" in response.json()["error"]["message"]
    # A malformed URL is not something the allowlist could fix: no hint there.
    response = client.post("/jobs", json={**GOOD, "webhook_url": "ftp://example.com/x"}, headers=auth(key))
    assert_error(response, 400, "invalid_webhook_url")
    assert "WEBHOOK_ALLOWLIST" not in response.json()["error"]["message"]


def test_the_key_in_x_api_key_or_a_wrong_scheme(client, make_key) -> None:  # type: ignore[no-untyped-def]
    key, _ = make_key()
    assert client.get("/jobs", headers={"X-API-Key": key}).status_code == 200
    for headers in ({"Authorization": key}, {"Authorization": f"Token {key}"}):
        response = client.get("/jobs", headers=headers)
        assert_error(response, 401, "unauthorized")
        message = response.json()["error"]["message"]
        assert "not 'Bearer <key>'" in message and "X-API-Key" in message, message
    response = client.get("/jobs")
    assert_error(response, 401, "unauthorized")
    assert "missing API key" in response.json()["error"]["message"]
    assert "X-API-Key" in response.json()["error"]["message"]
    assert_error(client.get("/jobs", headers={"X-API-Key": key + "x"}), 401, "unauthorized")


def test_docs_load_nothing_from_outside(client) -> None:  # type: ignore[no-untyped-def]
    page = client.get("/docs")
    assert page.status_code == 200
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    import re

    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    assets = [url for url in urls if url.endswith(("swagger-ui-bundle.js", "swagger-ui.css"))]
    assert len(assets) == 2, urls
    for url in assets:
        assert url.startswith("/"), url  # served here
        response = client.get(url)
        assert response.status_code == 200 and len(response.content) > 10_000, url


def test_the_cli_finds_the_embedded_key_from_any_folder(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import argparse
    import json
    import os

    from packscore import cli
    from packscore.client import Key, KeySource, service_record

    home = tmp_path / "service" / ".packscore"
    home.mkdir(parents=True)
    (home / "api_key").write_text("psk_embedded\nwhsec_x\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    url = "http://127.0.0.1:8000"
    record = service_record(url)
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"home": str(home), "pid": os.getpid()}))  # as `serve --embedded` records it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(cli, "EMBEDDED_DIR", cli.Path(".packscore"))
    monkeypatch.delenv("PACKSCORE_API_KEY", raising=False)
    monkeypatch.delenv("PACKSCORE_HOME", raising=False)
    args = argparse.Namespace(api_key=None, url=url)
    key = cli.api_key(args)
    assert (key.value, key.source) == ("psk_embedded", KeySource.RECORDED), key
    assert key.where.startswith(str(home / "api_key")), key
    # The service's own key file wins over the variable, which may name another service's key.
    monkeypatch.setenv("PACKSCORE_API_KEY", "psk_env")
    assert cli.api_key(args).value == "psk_embedded"
    assert cli.api_key(argparse.Namespace(api_key=None, url="http://127.0.0.1:8001")) == Key("psk_env",
                                                                                            KeySource.VARIABLE)
    assert cli.api_key(argparse.Namespace(api_key="psk_flag", url=url)) == Key("psk_flag", KeySource.OPTION)
    monkeypatch.delenv("PACKSCORE_API_KEY")
    record.unlink()
    key = cli.api_key(args)
    assert (key.value, key.source) == (None, KeySource.NONE) and "$PACKSCORE_API_KEY" in key.where
    assert str(elsewhere / ".packscore" / "api_key") in key.where


KEY_FILE = "/f/.packscore/api_key, this folder's embedded service's"
LOOKED = "no key found (looked in $PACKSCORE_API_KEY, /f/.packscore/api_key)"
WITH_OPTION = "give the key this service issued with --api-key (api_key=)"


@pytest.mark.parametrize(("source", "detail", "said"), [
    ("ARGUMENT", None, "(key from the api_key argument); give the key this service issued, or leave api_key out: "
                       "an embedded service's key file is found from its address"),
    ("OPTION", None, "(key from --api-key); give the key this service issued, or leave --api-key out: an embedded "
                     "service's key file is found from its address"),
    ("RECORDED", "/s/api_key, the embedded service's recorded at http://h:1",
     f"(key from /s/api_key, the embedded service's recorded at http://h:1); {WITH_OPTION}"),
    ("VARIABLE", None, f"(key from $PACKSCORE_API_KEY); {WITH_OPTION}, or set $PACKSCORE_API_KEY to it"),
    ("LOCAL", KEY_FILE, f"(key from {KEY_FILE}); {WITH_OPTION}, or set $PACKSCORE_API_KEY"),
    ("NONE", LOOKED, f"({LOOKED}); {WITH_OPTION}, or set $PACKSCORE_API_KEY to it"),
])
def test_a_refused_key_names_its_source_and_how_to_give_another(source: str, detail: str | None, said: str) -> None:
    """A 401's message says where the key came from and how to give another: not the variable where a recorded
    service's key file was used (that file wins over it)."""
    import httpx

    from packscore.client import Key, KeySource, PackscoreError, _raise_for_error

    refused = httpx.Response(401, json={"error": {"code": "unauthorized", "message": "invalid API key"}})
    with pytest.raises(PackscoreError) as raised:
        _raise_for_error(refused, Key("psk_x" if source != "NONE" else None, KeySource[source], detail))
    assert raised.value.message == f"invalid API key {said}"


def test_the_gguf_tokenizer_is_transformers_own(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """core reads a GGUF's tokenizer without PyTorch; what it builds is what AutoTokenizer builds."""
    import json

    from transformers import AutoTokenizer

    from core.requests import _gguf_tokenizer, bundled_model_path

    path = bundled_model_path()
    ours = _gguf_tokenizer(str(path))
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours.save_pretrained(tmp_path / "ours")
    reference.save_pretrained(tmp_path / "reference")
    for name in ("tokenizer.json", "special_tokens_map.json"):
        if (tmp_path / "reference" / name).exists():
            assert (tmp_path / "ours" / name).read_text() == (tmp_path / "reference" / name).read_text(), name
    config = {k: v for k, v in json.loads((tmp_path / "ours" / "tokenizer_config.json").read_text()).items()
              if k not in ("local_files_only", "is_local")}
    assert config == {k: v for k, v in json.loads((tmp_path / "reference" / "tokenizer_config.json").read_text())
                      .items() if k not in ("local_files_only", "is_local")}
    for text in ("Is the city in France? Answer yes or no.", "\nCity: Lyon\nAnswer:", " yes", "héllo 世界 🙂",
                 "<|im_start|>user\nhi<|im_end|>", "  two  spaces\t", ""):
        assert ours(text)["input_ids"] == reference(text)["input_ids"], text
        assert (ours(text, add_special_tokens=False)["input_ids"]
                == reference(text, add_special_tokens=False)["input_ids"]), text


def test_the_api_process_never_imports_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # As the API starts: the bundled model's tokenizer and the rerank template, first converted from the GGUF and
    # then read from MODEL_CACHE_DIR; torch is installed here (the tests use it) but must not be imported.
    import os
    import subprocess
    import sys

    code = ("import sys; from api.deps import get_models; "
            "t = get_models().get(None).tokenizer; "
            "r = t.tokenize('Is the city in France?', [' Lyon'], [9805, 787], False); assert r.n_items == 1; "
            "print('torch' in sys.modules)")
    env = {**os.environ, "MODEL": "smollm2-135m", "MODEL_CACHE_DIR": str(tmp_path)}
    for run in ("converting", "cached"):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == "False", (run, result.stdout)
    assert any(tmp_path.rglob("tokenizer.json"))  # the second run read the converted folder

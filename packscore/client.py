"""Python clients (httpx) for the packscore API: /v1/score, /v1/rerank, jobs and batches. `Client` is
synchronous; `AsyncClient` has the same methods as coroutines, for callers that fan out from asyncio. Each call
is defined once (`_Calls`); the two clients differ only in how they send it and wait.

Every call backs off and retries on 429, on a 503 that says "try again" (honouring Retry-After) and on connection
failures, so a long backfill rides out a restarting service: up to `max_retries` times, and for at most
`retry_seconds` from the call's first try when that is set (the CLI sets 30 s by default).
"""

import asyncio
import json
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from enum import Enum
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

import httpx

TERMINAL_JOB = ("succeeded", "failed", "cancelled")
TERMINAL_BATCH = ("completed", "cancelled", "failed")
RETRY_STATUSES = (429, 503)
# The one 503 that is not "try again": the job ran and its workers died MAX_ATTEMPTS times, so a POST sent again
# only makes another job that kills them. (Any other, a proxy's or a gateway's too, is retried.)
FINAL_503 = "worker_lost"
# A score or rerank call waits for the service's own answer (past SCORE_TIMEOUT_SECONDS it answers 504 with the
# job's id), but not for ever: a service that took the request and hangs is given up on after this long.
SCORE_READ_SECONDS = 600.0


class PackscoreError(Exception):
    """An error answer of the API: `status` (HTTP), `code` and `message` from its `{"error": ...}` body."""

    def __init__(self, status: int, code: str, message: str, body: dict | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body or {}


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # the HTTP-date form
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _no_answer(method: str, error: httpx.TransportError) -> None:
    """A POST with no answer in time is no sign of a service down: it may have run, and still be running."""
    if method != "GET" and isinstance(error, httpx.ReadTimeout):
        read = error.request.extensions.get("timeout", {}).get("read")
        raise PackscoreError(504, "no_answer", f"no answer to {method} {error.request.url.path} within {read:g} s; "
                             "the request may still have run (GET /jobs or /batches lists what it made)") from error


def _raise_for_error(response: httpx.Response, key: "Key") -> None:
    """`key`: the key sent, whose source a 401's message names with how to send another."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
        error = body["error"]
        message = error["message"]
        if response.status_code == 401:
            said = key.where if key.source is KeySource.NONE else f"key from {key.where}"
            message += f" ({said}); {key.source.another}"
        raise PackscoreError(response.status_code, error["code"], message, body)
    except (ValueError, KeyError, TypeError):
        raise PackscoreError(response.status_code, "http_error", response.text[:500]) from None


Content = Callable[[], Iterable[bytes] | AsyncIterable[bytes]]
R = TypeVar("R")


class _Calls(Generic[R]):
    """The API's calls, each built once: `_call` sends it and gives its JSON answer (Client), or an awaitable
    of it (AsyncClient)."""

    max_retries: int
    max_backoff: float
    retry_seconds: float | None = None
    timeout: float
    score_timeout: float
    key: "Key"
    _on_retry: Callable[[str], None] | None

    @property
    def key_source(self) -> str:
        """Where the key sent came from."""
        return self.key.where

    def _call(self, method: str, path: str, payload: Any = None, *, content: Content | None = None,
              **kwargs: Any) -> R:
        raise NotImplementedError

    def _retry_wait(self, method: str, attempt: int, started: float, response: httpx.Response | None = None,
                    error: httpx.TransportError | None = None) -> float | None:
        """Seconds to wait before sending again, or None to give up (the answer or error then stands): after
        max_retries retries, or when the next try would start more than retry_seconds after the first."""
        backoff = min(self.max_backoff, 0.5 * 2 ** attempt)
        if attempt >= self.max_retries:
            return None
        left = self.max_backoff * 10  # the longest a Retry-After may keep us: at most what is left of retry_seconds
        if self.retry_seconds is not None:
            left = min(left, max(0.0, started + self.retry_seconds - time.monotonic()))
            backoff = min(backoff, left)
            if backoff <= 0:
                return None
        if error is not None:
            # Connection refused or reset: the service is restarting. A POST that may have arrived is not
            # resent, except after a connect failure, which never reached the server.
            if method != "GET" and not isinstance(error, httpx.ConnectError):
                return None
            self._note_retry(f"{type(error).__name__}; retrying in {backoff:.1f}s")
            return backoff
        if response is None or response.status_code not in RETRY_STATUSES:
            return None
        if response.status_code == 503 and _error_code(response) == FINAL_503:
            return None
        wait = _retry_after(response)
        wait = backoff if wait is None else min(wait, left)
        self._note_retry(f"HTTP {response.status_code}; retrying in {wait:.1f}s")
        return wait

    def _note_retry(self, message: str) -> None:
        if self._on_retry is not None:
            self._on_retry(message)

    # ---- scoring, reranking and jobs ------------------------------------------------------

    def score(self, query: str | list[int], items: list, label_token_ids: list[int], *,
              apply_softmax: bool = False, item_first: bool = False, model: str | None = None) -> R:
        """POST /v1/score: waits for the scores. `model`: one of the service's (None: its default)."""
        body = {"query": query, "items": items, "label_token_ids": label_token_ids, "apply_softmax": apply_softmax,
                "item_first": item_first}
        return self._call("POST", "/v1/score", {**body, **({"model": model} if model else {})},
                          timeout=self._score_timeout())

    def rerank(self, query: str, documents: list[str] | list[dict], *, top_n: int | None = None,
               return_documents: bool = True, instruction: str | None = None, model: str | None = None) -> R:
        """POST /v1/rerank: `{"results": [{"index", "relevance_score", "document"?}]}`, most relevant first."""
        body = {"query": query, "documents": documents, "top_n": top_n, "return_documents": return_documents,
                "instruction": instruction, "model": model}
        return self._call("POST", "/v1/rerank", {k: v for k, v in body.items() if v is not None},
                          timeout=self._score_timeout())

    def _score_timeout(self) -> httpx.Timeout:
        # The service answers these itself when they run long (504 `timeout` with the job's id, after its
        # SCORE_TIMEOUT_SECONDS): a read timeout of ours at or below that would cut that answer off.
        return httpx.Timeout(self.timeout, read=self.score_timeout)

    def submit_job(self, request: dict, *, idempotency_key: str | None = None) -> R:
        """POST /jobs with the body of docs/score-semantics.md (plus return_logprobs, webhook_url, metadata), or a
        rerank body with `"kind": "rerank"`."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/jobs", request, headers=headers)

    def get_job(self, job_id: str) -> R:
        return self._call("GET", f"/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> R:
        return self._call("POST", f"/jobs/{job_id}/cancel")

    # ---- batches --------------------------------------------------------------------------

    def create_batch(self, requests: list[dict] | Content, *, webhook_url: str | None = None,
                     metadata: dict | None = None, timeout: httpx.Timeout | None = None,
                     model: str | None = None) -> R:
        """POST /batches. `requests` is a list of request dicts (sent as one JSON body) or, for large batches,
        a function returning the JSONL file's bytes in chunks (streamed; called again if the upload is retried).
        `timeout`: this call's, instead of the client's (the answer comes once the whole upload is ingested:
        `httpx.Timeout(60.0, read=None)` waits for it however long that takes). `model`: the batch's (None: the
        service's default)."""
        options = {"timeout": timeout} if timeout is not None else {}
        if isinstance(requests, list):
            body = {"requests": requests, "webhook_url": webhook_url, "metadata": metadata}
            return self._call("POST", "/batches", {**body, **({"model": model} if model else {})}, **options)
        params = {k: v for k, v in (("webhook_url", webhook_url), ("model", model),
                                    ("metadata", json.dumps(metadata) if metadata is not None else None)) if v}
        return self._call("POST", "/batches", content=requests, params=params,
                          headers={"content-type": "application/jsonl"}, **options)

    def create_reference_batch(self, input: str | list[str], output: str, *, format: str | None = None,
                               columns: dict | None = None, label_token_ids: list[int] | None = None,
                               dry_run: bool = False, **options: Any) -> R:
        """POST /batches naming data in storage instead of carrying it (README "Backfills from object storage"):
        `input` a URI, a list of them or a glob (s3://, gs://, az://, or a local path the service may read),
        `output` a URI prefix; a pair table's `columns` ({"query", "item", "ids", "label"}) and labels; other
        options as the body takes them (output_format, apply_softmax, return_logprobs, webhook_url, metadata).
        `dry_run`: POST /batches/plan instead, the plan and an estimate of its time, nothing created."""
        body = {"input": input, "output": output, "format": format, "columns": columns,
                "label_token_ids": label_token_ids, **options}
        return self._call("POST", "/batches/plan" if dry_run else "/batches",
                          {k: v for k, v in body.items() if v is not None})

    def get_batch(self, batch_id: str) -> R:
        return self._call("GET", f"/batches/{batch_id}")

    def list_batches(self, *, limit: int = 20, cursor: str | None = None) -> R:
        return self._call("GET", "/batches", params={"limit": limit, **({"cursor": cursor} if cursor else {})})

    def cancel_batch(self, batch_id: str) -> R:
        return self._call("POST", f"/batches/{batch_id}/cancel")


def _request(http: httpx.Client | httpx.AsyncClient, method: str, path: str, payload: Any, content: Content | None,
             kwargs: dict) -> httpx.Request:
    headers = kwargs.pop("headers", {})
    if payload is not None:
        headers = {"content-type": "application/json", **headers}
        body = json.dumps(payload).encode()
    else:
        body = content() if content else None  # anew for each attempt: an upload generator cannot be replayed
    return http.build_request(method, path, content=body, headers=headers, **kwargs)


def _base_url(base_url: str | None) -> str:
    return base_url or os.environ.get("PACKSCORE_URL", "http://127.0.0.1:8000")


# ---- which key a service takes ---------------------------------------------------------------------------------

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::", "")


def embedded_home() -> Path:
    """Where `serve --embedded` started from this folder keeps its database, broker folder, caches and first API
    key: $PACKSCORE_HOME, else .packscore here. The service records that folder per address it serves
    (`service_record`), so that clients send each service its own key from any folder."""
    return Path(os.environ.get("PACKSCORE_HOME", ".packscore"))


def service_record(url: str) -> Path:
    """The file in which `serve --embedded` records the home folder of the service it runs at this URL's host and
    port: one per address, so two services on one account (two clones) each keep their own key."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = (parts.hostname or "").lower()
    host = "local" if host in LOOPBACK_HOSTS or host.startswith("127.") else host
    port = parts.port or (443 if parts.scheme == "https" else 80)
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "packscore" / "services" / f"{host}-{port}.json"


def recorded_home(url: str) -> Path | None:
    """The home folder of the embedded service running at `url`, from its record; None without a record or when
    the process that wrote it has ended (a service that crashed leaves its record behind)."""
    try:
        record = json.loads(service_record(url).read_text())
        os.kill(int(record["pid"]), 0)
    except PermissionError:  # alive, another user's
        pass
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Path(record["home"])


class KeySource(Enum):
    """Where a key came from: its name, and how to send another when the service refuses it (a 401's message)."""

    ARGUMENT = ("the api_key argument", "give the key this service issued, or leave api_key out: an embedded "
                "service's key file is found from its address")
    OPTION = ("--api-key", "give the key this service issued, or leave --api-key out: an embedded service's key "
              "file is found from its address")
    # The variable is read only where no recorded service's key file is: that file wins over it.
    RECORDED = ("the recorded embedded service's key file", "give the key this service issued with --api-key "
                "(api_key=)")
    VARIABLE = ("$PACKSCORE_API_KEY", "give the key this service issued with --api-key (api_key=), or set "
                "$PACKSCORE_API_KEY to it")
    LOCAL = ("this folder's embedded service's key file", "give the key this service issued with --api-key "
             "(api_key=), or set $PACKSCORE_API_KEY")
    NONE = ("no key found", "give the key this service issued with --api-key (api_key=), or set "
            "$PACKSCORE_API_KEY to it")

    def __init__(self, named: str, another: str) -> None:
        self.named, self.another = named, another


@dataclass(frozen=True)
class Key:
    """A key for a service (None: none found) and its source."""

    value: str | None
    source: KeySource
    detail: str | None = None  # a key file's path and whose it is; with no key, every place looked in

    @property
    def where(self) -> str:
        """The key's source as a 401's message names it."""
        return self.detail or self.source.named


def find_key(url: str, home: Path | None = None) -> Key:
    """The key for the service at `url`: the key file of the embedded service recorded at that address, else
    $PACKSCORE_API_KEY, else the key file in `home` (default `embedded_home()`)."""
    recorded = recorded_home(url)
    if recorded is not None and (recorded / "api_key").is_file():
        path = recorded / "api_key"
        return Key(path.read_text().split()[0], KeySource.RECORDED, f"{path}, the embedded service's recorded at {url}")
    if os.environ.get("PACKSCORE_API_KEY"):
        return Key(os.environ["PACKSCORE_API_KEY"], KeySource.VARIABLE)
    local = (home or embedded_home()).resolve() / "api_key"
    if local.is_file():
        return Key(local.read_text().split()[0], KeySource.LOCAL, f"{local}, this folder's embedded service's")
    looked = ", ".join([*([str(recorded / "api_key")] if recorded is not None else []), "$PACKSCORE_API_KEY",
                        str(local)])
    return Key(None, KeySource.NONE, f"no key found (looked in {looked})")


def find_api_key(url: str, home: Path | None = None) -> tuple[str | None, str]:
    """`find_key`'s key and where it came from, as text."""
    key = find_key(url, home)
    return key.value, key.where


def _key(base_url: str, api_key: str | Key | None) -> Key:
    if isinstance(api_key, Key):
        return api_key
    return find_key(base_url) if api_key is None else Key(api_key, KeySource.ARGUMENT)


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Client(_Calls[dict]):
    """`Client(base_url, api_key)`; the URL defaults to $PACKSCORE_URL, the key to `find_key`'s for that URL (a
    `Key` given names its source in a 401's message).
    `timeout` (seconds) is each call's, except that score and rerank wait longer for the service's own answer
    (`score_timeout`, SCORE_READ_SECONDS by default; no answer in time raises PackscoreError 504 `no_answer`)."""

    def __init__(self, base_url: str | None = None, api_key: str | Key | None = None, *, timeout: float = 60.0,
                 max_retries: int = 8, max_backoff: float = 30.0, sleep: Callable[[float], None] = time.sleep,
                 on_retry: Callable[[str], None] | None = None, retry_seconds: float | None = None,
                 score_timeout: float = SCORE_READ_SECONDS) -> None:
        self.timeout = timeout
        self.score_timeout = score_timeout
        self.max_retries = max_retries
        self.max_backoff = max_backoff
        self.retry_seconds = retry_seconds
        self._sleep = sleep
        self._on_retry = on_retry
        base_url = _base_url(base_url)
        self.key = _key(base_url, api_key)
        self._http = httpx.Client(base_url=base_url, timeout=timeout, headers=_auth(self.key.value))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, payload: Any = None, *, content: Content | None = None,
              stream: bool = False, **kwargs: Any) -> httpx.Response:
        """One call with retries."""
        started = time.monotonic()
        for attempt in range(self.max_retries + 1):
            request = _request(self._http, method, path, payload, content, dict(kwargs))
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if (wait := self._retry_wait(method, attempt, started, error=exc)) is None:
                    _no_answer(method, exc)
                    raise
                self._sleep(wait)
                continue
            if response.status_code >= 400 and stream:
                response.read()  # its error code decides whether to retry
            if (wait := self._retry_wait(method, attempt, started, response)) is not None:
                response.close()
                self._sleep(wait)
                continue
            _raise_for_error(response, self.key)
            return response
        raise AssertionError("unreachable")

    def _call(self, method: str, path: str, payload: Any = None, **kwargs: Any) -> Any:
        return self._send(method, path, payload, **kwargs).json()

    def _wait(self, read: Callable[[str], dict], kind: str, object_id: str, terminal: tuple[str, ...], poll: float,
              timeout: float | None) -> dict:
        """Reads the job or batch every `poll` seconds until its status is one of `terminal`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (found := read(object_id))["status"] not in terminal:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{kind} {object_id} is still {found['status']}")
            self._sleep(poll)
        return found

    def wait_job(self, job_id: str, *, poll: float = 0.5, timeout: float | None = None) -> dict:
        return self._wait(self.get_job, "job", job_id, TERMINAL_JOB, poll, timeout)

    def iter_batch_results(self, batch_id: str, *, format: str = "packscore") -> Iterator[dict]:
        """The finished requests so far, streamed: `{"custom_id", "scores", "logprobs"?, "error"?}`, or with
        format="openai" OpenAI Batch API output lines."""
        response = self._send("GET", f"/batches/{batch_id}/results", stream=True, params={"format": format})
        try:
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)
        finally:
            response.close()

    def wait_batch(self, batch_id: str, *, poll: float = 1.0, timeout: float | None = None) -> dict:
        return self._wait(self.get_batch, "batch", batch_id, TERMINAL_BATCH, poll, timeout)


async def _async_chunks(chunks: Iterable[bytes] | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    # httpx.AsyncClient streams only async iterables; a file read in chunks is a plain one.
    if isinstance(chunks, AsyncIterable):
        async for chunk in chunks:
            yield chunk
    else:
        for chunk in chunks:
            yield chunk


class AsyncClient(_Calls[Awaitable[dict]]):
    """`Client`'s methods as coroutines, on httpx.AsyncClient: `async with AsyncClient(url, key) as client:`."""

    def __init__(self, base_url: str | None = None, api_key: str | Key | None = None, *, timeout: float = 60.0,
                 max_retries: int = 8, max_backoff: float = 30.0,
                 on_retry: Callable[[str], None] | None = None, retry_seconds: float | None = None,
                 score_timeout: float = SCORE_READ_SECONDS) -> None:
        self.timeout = timeout
        self.score_timeout = score_timeout
        self.max_retries = max_retries
        self.max_backoff = max_backoff
        self.retry_seconds = retry_seconds
        self._on_retry = on_retry
        base_url = _base_url(base_url)
        self.key = _key(base_url, api_key)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=_auth(self.key.value))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, method: str, path: str, payload: Any = None, *, content: Content | None = None,
                    stream: bool = False, **kwargs: Any) -> httpx.Response:
        """One call with retries."""
        chunks = (lambda: _async_chunks(content())) if content else None
        started = time.monotonic()
        for attempt in range(self.max_retries + 1):
            request = _request(self._http, method, path, payload, chunks, dict(kwargs))
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if (wait := self._retry_wait(method, attempt, started, error=exc)) is None:
                    _no_answer(method, exc)
                    raise
                await asyncio.sleep(wait)
                continue
            if response.status_code >= 400 and stream:
                await response.aread()  # its error code decides whether to retry
            if (wait := self._retry_wait(method, attempt, started, response)) is not None:
                await response.aclose()
                await asyncio.sleep(wait)
                continue
            _raise_for_error(response, self.key)
            return response
        raise AssertionError("unreachable")

    async def _call(self, method: str, path: str, payload: Any = None, **kwargs: Any) -> Any:
        return (await self._send(method, path, payload, **kwargs)).json()

    async def _wait(self, read: Callable[[str], Awaitable[dict]], object_id: str, terminal: tuple[str, ...],
                    poll: float, timeout: float | None) -> dict:
        """As Client._wait (TimeoutError without a message)."""
        async with asyncio.timeout(timeout):
            while (found := await read(object_id))["status"] not in terminal:
                await asyncio.sleep(poll)
        return found

    async def wait_job(self, job_id: str, *, poll: float = 0.5, timeout: float | None = None) -> dict:
        return await self._wait(self.get_job, job_id, TERMINAL_JOB, poll, timeout)

    async def iter_batch_results(self, batch_id: str, *, format: str = "packscore") -> AsyncIterator[dict]:
        """As Client.iter_batch_results."""
        response = await self._send("GET", f"/batches/{batch_id}/results", stream=True, params={"format": format})
        try:
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)
        finally:
            await response.aclose()

    async def wait_batch(self, batch_id: str, *, poll: float = 1.0, timeout: float | None = None) -> dict:
        return await self._wait(self.get_batch, batch_id, TERMINAL_BATCH, poll, timeout)

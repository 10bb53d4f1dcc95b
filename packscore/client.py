"""A synchronous Python client (httpx) for the packscore API: /v1/score, jobs and batches.

Every call backs off and retries on 429 and 503 (honouring Retry-After) and on connection failures, so a
long backfill rides out a restarting service.
"""

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

TERMINAL_JOB = ("succeeded", "failed", "cancelled")
TERMINAL_BATCH = ("completed", "cancelled", "failed")
RETRY_STATUSES = (429, 503)


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


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
        error = body["error"]
        raise PackscoreError(response.status_code, error["code"], error["message"], body)
    except (ValueError, KeyError, TypeError):
        raise PackscoreError(response.status_code, "http_error", response.text[:500]) from None


class Client:
    """`Client(base_url, api_key)`; the key defaults to $PACKSCORE_API_KEY and the URL to $PACKSCORE_URL."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 60.0,
                 max_retries: int = 8, max_backoff: float = 30.0, sleep: Callable[[float], None] = time.sleep,
                 on_retry: Callable[[str], None] | None = None) -> None:
        base_url = base_url or os.environ.get("PACKSCORE_URL", "http://127.0.0.1:8000")
        api_key = api_key or os.environ.get("PACKSCORE_API_KEY", "")
        self.max_retries = max_retries
        self.max_backoff = max_backoff
        self._sleep = sleep
        self._on_retry = on_retry
        self._http = httpx.Client(base_url=base_url, timeout=timeout,
                                  headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, *, body: Callable[[], Any] | None = None, stream: bool = False,
              **kwargs: Any) -> httpx.Response:
        """One call with retries. `body` builds the request content anew for each attempt (an upload
        generator cannot be replayed)."""
        for attempt in range(self.max_retries + 1):
            backoff = min(self.max_backoff, 0.5 * 2 ** attempt)
            request = self._http.build_request(method, path, content=body() if body else None, **kwargs)
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                # Connection refused or reset: the service is restarting. A POST that may have arrived is
                # not resent, except a connect failure, which never reached the server.
                if attempt == self.max_retries or (method != "GET" and not isinstance(exc, httpx.ConnectError)):
                    raise
                self._note_retry(f"{type(exc).__name__}; retrying in {backoff:.1f}s")
                self._sleep(backoff)
                continue
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                wait = _retry_after(response)
                wait = backoff if wait is None else min(wait, self.max_backoff * 10)
                response.close()
                self._note_retry(f"HTTP {response.status_code}; retrying in {wait:.1f}s")
                self._sleep(wait)
                continue
            if response.status_code >= 400 and stream:
                response.read()
            _raise_for_error(response)
            return response
        raise AssertionError("unreachable")

    def _note_retry(self, message: str) -> None:
        if self._on_retry is not None:
            self._on_retry(message)

    def _json(self, method: str, path: str, payload: Any = None, **kwargs: Any) -> Any:
        body = None if payload is None else (lambda: json.dumps(payload).encode())
        headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
        return self._send(method, path, body=body, headers=headers, **kwargs).json()

    # ---- scoring and jobs -----------------------------------------------------------------

    def score(self, query: str | list[int], items: list, label_token_ids: list[int], *,
              apply_softmax: bool = False, item_first: bool = False) -> dict:
        """POST /v1/score: waits for the scores."""
        return self._json("POST", "/v1/score", {"query": query, "items": items, "label_token_ids": label_token_ids,
                                                "apply_softmax": apply_softmax, "item_first": item_first})

    def submit_job(self, request: dict, *, idempotency_key: str | None = None) -> dict:
        """POST /jobs with the body of score-semantics.md (plus return_logprobs, webhook_url, metadata)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json("POST", "/jobs", request, headers=headers)

    def get_job(self, job_id: str) -> dict:
        return self._json("GET", f"/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict:
        return self._json("POST", f"/jobs/{job_id}/cancel")

    def wait_job(self, job_id: str, *, poll: float = 0.5, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (job := self.get_job(job_id))["status"] not in TERMINAL_JOB:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['status']}")
            self._sleep(poll)
        return job

    # ---- batches --------------------------------------------------------------------------

    def create_batch(self, requests: list[dict] | Callable[[], Iterable[bytes]], *, webhook_url: str | None = None,
                     metadata: dict | None = None) -> dict:
        """POST /batches. `requests` is a list of request dicts (sent as one JSON body) or, for large batches,
        a function returning the JSONL file's bytes in chunks (streamed; called again if the upload is retried)."""
        if isinstance(requests, list):
            payload = {"requests": requests, "webhook_url": webhook_url, "metadata": metadata}
            return self._json("POST", "/batches", payload)
        params = {k: v for k, v in (("webhook_url", webhook_url),
                                    ("metadata", json.dumps(metadata) if metadata is not None else None)) if v}
        return self._send("POST", "/batches", body=requests, params=params,
                          headers={"content-type": "application/jsonl"}).json()

    def get_batch(self, batch_id: str) -> dict:
        return self._json("GET", f"/batches/{batch_id}")

    def list_batches(self, *, limit: int = 20, cursor: str | None = None) -> dict:
        return self._json("GET", "/batches", params={"limit": limit, **({"cursor": cursor} if cursor else {})})

    def cancel_batch(self, batch_id: str) -> dict:
        return self._json("POST", f"/batches/{batch_id}/cancel")

    def iter_batch_results(self, batch_id: str) -> Iterator[dict]:
        """The finished requests so far, streamed: `{"custom_id", "scores", "logprobs"?, "error"?}`."""
        response = self._send("GET", f"/batches/{batch_id}/results", stream=True)
        try:
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)
        finally:
            response.close()

    def wait_batch(self, batch_id: str, *, poll: float = 1.0, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (batch := self.get_batch(batch_id))["status"] not in TERMINAL_BATCH:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} is still {batch['status']}")
            self._sleep(poll)
        return batch

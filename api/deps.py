"""FastAPI dependencies: database session, current API key, the served models (for validation)."""

import logging
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.auth import cached_api_key, find_api_key
from api.waiter import JobWaiter
from store.catalog import ModelCatalog
from store.db import session_factory
from store.errors import ServiceError
from store.models import ApiKey
from store.settings import Settings, get_settings

log = logging.getLogger(__name__)


def _close(session: Session) -> None:
    try:
        session.close()
    except DBAPIError as exc:
        # The database went away after the request's work (Postgres stopped): the close-time ROLLBACK fails
        # after the response has started, which would abort the connection. The pool drops the connection.
        log.warning("closing a session failed (database gone?): %s", exc.orig)


async def get_db() -> AsyncIterator[Session]:
    # On the event loop: a new session has no connection yet, and one whose route committed has none left, so
    # neither does I/O here (a sync dependency costs two trips through the thread pool per request). Closing a
    # session still in a transaction rolls back over the network: that goes to a thread.
    session = session_factory()()
    try:
        yield session
    finally:
        if session.in_transaction():
            await run_in_threadpool(_close, session)
        else:
            _close(session)


# scope="function": the session closes when the route function returns, not after the response is sent. A sync
# route's response is serialized in a worker thread; a connection held until then is held while that thread is
# waited for, and under a burst every pooled connection would be held so.
SessionDep = Annotated[Session, Depends(get_db, scope="function")]


async def get_api_settings() -> Settings:
    # On the event loop: FastAPI runs a sync dependency (get_settings itself) in the thread pool, a trip through
    # it per request for a cached value.
    return get_settings()


SettingsDep = Annotated[Settings, Depends(get_api_settings)]


@lru_cache(maxsize=1)
def get_models() -> ModelCatalog:
    """The deployment's models (MODELS, or MODEL alone), each one's tokenizer, limits and rerank prompt, without
    their weights: the API never loads a model. It validates and tokenizes every request with the engine's own
    rules and error codes."""
    return ModelCatalog.load(get_settings())


async def _loaded_models() -> ModelCatalog:
    # On the event loop, not in a thread (a thread hop per request costs more than the call): the app loads it
    # before it takes traffic (main.lifespan), so this never blocks.
    return get_models()


ModelsDep = Annotated[ModelCatalog, Depends(_loaded_models)]

_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer psk_...`")
_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key: `X-API-Key: psk_...`")
HOW_TO_SEND_KEY = "send it as 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"


def _read_api_key(presented: str) -> ApiKey | None:
    # A session of its own, closed at once: the connection goes back to the pool now. The request's session
    # (SessionDep) is not a dependency of authentication: the key is read from the database only on a cache miss,
    # and solving that dependency costs every request (FastAPI solves a sub-dependency again for each dependant).
    with session_factory()() as session:
        return find_api_key(session, presented)


async def get_api_key(request: Request,
                      credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                      header_key: Annotated[str | None, Depends(_key_header)] = None) -> ApiKey:
    challenge = {"WWW-Authenticate": "Bearer"}
    if credentials is not None:
        presented = credentials.credentials
    elif header_key:
        presented = header_key
    elif "authorization" in request.headers:
        raise ServiceError(401, "unauthorized", f"the Authorization header is not 'Bearer <key>': {HOW_TO_SEND_KEY}",
                           challenge)
    else:
        raise ServiceError(401, "unauthorized", f"missing API key: {HOW_TO_SEND_KEY}", challenge)
    # A cached key is checked on the event loop; only a database read goes to a thread.
    key = cached_api_key(presented) or await run_in_threadpool(_read_api_key, presented)
    if key is None:
        raise ServiceError(401, "unauthorized", "invalid API key", challenge)
    return key


CurrentKey = Annotated[ApiKey, Depends(get_api_key)]


async def get_job_waiter(request: Request) -> JobWaiter:
    return request.app.state.job_waiter


JobWaiterDep = Annotated[JobWaiter, Depends(get_job_waiter)]

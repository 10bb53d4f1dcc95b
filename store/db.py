"""Database engine and sessions (SQLAlchemy 2). Postgres in production, SQLite in embedded mode."""

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from sqlalchemy import ARRAY, Engine, String, any_, bindparam, create_engine, event
from sqlalchemy.exc import InvalidatePoolError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql import ColumnElement, Select

from store.settings import get_settings

PING_IDLE_SECONDS = 1.0


@lru_cache
def get_engine(url: str | None = None) -> Engine:
    settings = get_settings()
    url = url or settings.database_url
    # LIFO: the connection checked in last is handed out next, so after a burst light traffic keeps to one or two
    # connections instead of going round the whole pool, whose page caches would each fill; and the few in use are
    # seldom idle long enough to need the ping below.
    pool = {"pool_size": settings.db_pool_size, "max_overflow": settings.db_max_overflow,
            "pool_timeout": settings.db_pool_timeout_seconds, "pool_use_lifo": True}
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record):  # type: ignore[no-untyped-def]
            # WAL lets the API read while the worker process writes.
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA foreign_keys=ON")

        return engine
    # connect_timeout: an unreachable database gives a quick 503, not a hung request.
    engine = create_engine(url, connect_args={"connect_timeout": 5}, **pool)

    @event.listens_for(engine, "checkin")
    def _checked_in(_conn, record):  # type: ignore[no-untyped-def]
        record.info["checked_in"] = time.monotonic()  # record.info is cleared when its connection is replaced

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(conn, record, _proxy):  # type: ignore[no-untyped-def]
        # After a database restart, stale pooled connections are replaced instead of failing a request. Only
        # connections idle for a while are pinged: a ping on every checkout (pool_pre_ping) is a round trip
        # per request. A connection used within PING_IDLE_SECONDS of a restart fails its next request with a
        # retryable 503, and that disconnect makes SQLAlchemy replace every connection of the pool.
        if time.monotonic() - record.info.get("checked_in", math.inf) > PING_IDLE_SECONDS:
            try:
                engine.dialect.do_ping(conn)
            except engine.dialect.loaded_dbapi.Error as exc:
                raise InvalidatePoolError(str(exc)) from exc  # the pool reconnects, this one first

    return engine


def session_factory() -> sessionmaker[Session]:
    return _sessionmaker(get_engine())


@lru_cache
def _sessionmaker(engine: Engine) -> sessionmaker[Session]:
    # One per engine: each sessionmaker is a new Session subclass whose event dispatch SQLAlchemy builds again, a
    # cost the API would pay per request.
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope() -> Iterator[Session]:
    """One transaction: commit on success, roll back on error (worker side)."""
    with session_factory()() as session, session.begin():
        yield session


def among(session: Session, column: ColumnElement, values: list[str]) -> ColumnElement:
    """`column IN values`. On Postgres as `= ANY(array)`: one statement text whatever the number of values, so
    SQLAlchemy's and psycopg's statement caches serve it (each IN-list length is a statement of its own)."""
    if session.get_bind().dialect.name == "postgresql":
        return column == any_(bindparam(None, list(values), type_=ARRAY(String)))
    return column.in_(values)


def newest_first(session: Session, query: Select, id_column: Any, limit: int,
                 cursor: str | None) -> tuple[list[Any], str | None]:
    """A page of `query`'s rows, newest first (ids grow with time: store.models.new_id), and the next page's
    cursor (this page's last id; None on the last page). `cursor`: the one the previous page gave."""
    query = query.order_by(id_column.desc()).limit(limit + 1)
    if cursor:
        query = query.where(id_column < cursor)
    rows = list(session.scalars(query))
    return rows[:limit], (rows[limit - 1].id if len(rows) > limit else None)

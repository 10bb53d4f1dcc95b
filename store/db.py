"""Database engine and sessions (SQLAlchemy 2). Postgres in production, SQLite in embedded mode."""

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from store.settings import get_settings


@lru_cache
def get_engine(url: str | None = None) -> Engine:
    settings = get_settings()
    url = url or settings.database_url
    pool = {"pool_size": settings.db_pool_size, "max_overflow": settings.db_max_overflow,
            "pool_timeout": settings.db_pool_timeout_seconds}
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record):  # type: ignore[no-untyped-def]
            # WAL lets the API read while the worker process writes.
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA foreign_keys=ON")

        return engine
    # pre_ping: after a database restart, stale pooled connections are replaced instead of failing a request.
    # connect_timeout: an unreachable database gives a quick 503, not a hung request.
    return create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 5}, **pool)


def session_factory() -> sessionmaker[Session]:
    return sessionmaker(get_engine(), expire_on_commit=False)


@contextmanager
def session_scope() -> Iterator[Session]:
    """One transaction: commit on success, roll back on error (worker side)."""
    with session_factory()() as session, session.begin():
        yield session

"""Alembic migrations: the only way tables are created outside tests' own setup."""

from pathlib import Path

from alembic import command
from alembic.config import Config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Bring the database at `database_url` to `revision` (what `packscore migrate` runs)."""
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent))
    config.attributes["database_url"] = database_url
    command.upgrade(config, revision)

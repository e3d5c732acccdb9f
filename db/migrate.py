"""Schema upgrades through Alembic, callable from the app at start-up and from
`gpubot db upgrade`. On PostgreSQL an advisory lock makes two replicas that start
together take turns instead of racing the same DDL."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_LOCK_ID = 0x6770_7562  # "gpub"


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> str | None:
    """Brings the schema to head; a no-op when it is there already. Returns the head."""
    head = head_revision()
    if current_revision(engine) == head:
        return head
    cfg = alembic_config()
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_ID})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    return head

"""The Alembic history creates exactly the tables the models describe, on both databases."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Engine
from sqlmodel import SQLModel

import db.models  # noqa: F401
from db.migrate import current_revision, head_revision, upgrade


def test_migrations_match_the_models(engine: Engine) -> None:
    assert current_revision(engine) == head_revision()
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    assert diff == []


def test_upgrade_twice_is_a_no_op(engine: Engine) -> None:
    assert upgrade(engine) == head_revision()
    assert current_revision(engine) == head_revision()

"""Alembic environment: the metadata is SQLModel's, the connection is handed in by
`db.migrate.upgrade` (so the app and `gpubot db upgrade` share one code path)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import db.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from db.session import make_engine

config = context.config
target_metadata = SQLModel.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = make_engine(config.get_main_option("sqlalchemy.url") or "")
        with engine.connect() as conn:
            _run(conn)
        return
    _run(connection)


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode copies the table
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `gpubot db upgrade`")
run_migrations_online()

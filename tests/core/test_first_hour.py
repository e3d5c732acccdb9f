"""What a new team meets in its first hour (issue 19): the figures a reply shows are
right — counts never negative, booting instances not free, an estimate where one is
known — and each view says what it means in plain words."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from sqlalchemy.engine import Engine

from bot.commands import Queue, Run, Status
from bot.runs import LocalAccess, RunService
from bot.service import GpuService
from provisioning.base import Instance
from provisioning.catalog import Catalog
from provisioning.local_runner import LOCAL_TARGET, LocalRunner
from tests.core.helpers import actor, host, make_service


def runs_for(svc: GpuService, tmp_path: Path) -> RunService:
    runs = RunService(
        svc, LocalAccess(LocalRunner(), LOCAL_TARGET, tmp_path / "runs"), Catalog.load()
    )
    svc.runs = runs
    return runs


def booting(name: str, gpus: int, hourly: float) -> Instance:
    return replace(host(name, "A100", gpus, hourly=hourly), provider="aws", state="pending")


def test_queue_me_counts_only_my_runs(sqlite_engine: Engine, tmp_path: Path) -> None:
    svc, _ = make_service(sqlite_engine, [host("box", "A100", 1)])
    runs = runs_for(svc, tmp_path)
    for who in ("alice", "alice", "bob"):
        runs.submit(actor(svc, who), Run(recipe="digits", model="A100"))
    mine = runs.queue(actor(svc, "bob"), Queue(mine_only=True)).view.text
    assert mine == "1 waiting, 0 running"
    assert runs.queue(actor(svc, "bob"), Queue()).view.text == "3 waiting, 0 running"


def test_booting_instances_are_not_free(sqlite_engine: Engine) -> None:
    svc, _ = make_service(
        sqlite_engine, [booting("i-1", 8, 32.77), host("box", "A100", 1)], provider="aws"
    )
    view = svc.status(actor(svc, "alice"), Status()).view
    assert view.text == "1 of 1 free on 1 host; 8 starting up"
    rows = [b for b in view.blocks if getattr(b, "type", "") == "table"]
    assert any(r[2] == "starting up" for t in rows for r in t.rows)  # type: ignore[attr-defined]


def test_an_empty_cloud_pool_says_the_first_request_launches(sqlite_engine: Engine) -> None:
    svc, _ = make_service(sqlite_engine, [], provider="aws")
    text = " ".join(
        getattr(b, "text", "") for b in svc.status(actor(svc, "a"), Status()).view.blocks
    )
    assert "No hosts are configured" not in text
    assert "launches one" in text


def test_queue_estimates_a_run_that_waits_for_a_booting_instance(
    sqlite_engine: Engine, tmp_path: Path
) -> None:
    svc, _ = make_service(sqlite_engine, [booting("i-1", 1, 4.10)], provider="aws")
    runs = runs_for(svc, tmp_path)
    a = actor(svc, "alice")
    runs.submit(a, Run(recipe="digits", model="A100", max_duration=timedelta(hours=2)))
    table = runs.queue(a, Queue()).view.blocks[-1]
    row = table.rows[0]  # type: ignore[attr-defined]
    assert "unknown" not in row
    assert row[-1] == "$8.20"
    assert row[-3].startswith("in ")

"""The status file contract: what the bot reads over SSH must always parse and never lose fields."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.training.conftest import REPO, runner_env
from training import status as st
from training.status import (
    SCHEMA_VERSION,
    RunStatus,
    StatusFile,
    Summary,
    parse_status,
    read_status,
    report,
    write_status,
)


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    original = RunStatus(
        state="done",
        step=42,
        total_steps=100,
        loss=0.25,
        metrics={"test_accuracy": 0.97},
        precision="bf16",
        batch_size=64,
        warnings=["w"],
        summary=Summary(final_metrics={"test_accuracy": 0.97}, wall_s=3.5, steps=42),
    )
    write_status(path, original)
    loaded = read_status(path)
    assert loaded == original
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION


def test_reader_returns_none_for_what_it_cannot_trust(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    assert read_status(path) is None
    path.write_text('{"schema_version": 1, "state": "runn')
    assert read_status(path) is None
    assert parse_status(json.dumps({"schema_version": SCHEMA_VERSION + 1, "state": "done"})) is None
    assert parse_status(json.dumps({"schema_version": 1, "state": "exploded"})) is None
    assert parse_status(json.dumps({"schema_version": 1, "state": "done", "step": "7"})) is None
    assert parse_status("[1, 2]") is None


def test_reader_ignores_fields_added_later() -> None:
    text = json.dumps({"schema_version": 1, "state": "running", "step": 3, "new_field": {"x": 1}})
    loaded = parse_status(text)
    assert loaded is not None and loaded.step == 3


def test_nan_loss_is_written_as_null_not_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    write_status(path, RunStatus(state="running", loss=float("nan"), metrics={"a": float("inf")}))
    data = json.loads(path.read_text())
    assert data["loss"] is None and data["metrics"] == {}


def test_update_rejects_unknown_fields(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="stpe"):
        StatusFile(tmp_path / "s.json").update(stpe=3)


def test_two_writers_lose_no_updates(tmp_path: Path) -> None:
    """The runner and the user's script both write the file; the lock must serialize them."""
    sf = StatusFile(tmp_path / "s.json")
    sf.reset(RunStatus(state="running"))
    rounds = 40

    def bump(s: RunStatus) -> None:
        s.step += 1

    def steps() -> None:
        for _ in range(rounds):
            sf.update(bump)

    def metrics() -> None:
        for i in range(rounds):

            def add(s: RunStatus, i: int = i) -> None:
                s.metrics[f"m{i}"] = float(i)

            sf.update(add)

    threads = [threading.Thread(target=steps), threading.Thread(target=metrics)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    final = sf.read()
    assert final is not None
    assert final.step == rounds
    assert len(final.metrics) == rounds


_WRITER = """
import sys
from training.status import RunStatus, StatusFile
sf = StatusFile(sys.argv[1])
big = ["x" * 400] * 500  # ~200 kB per document, so a non-atomic write would be caught torn
for i in range(int(sys.argv[2])):
    sf.update(step=i, log_tail=big, state="running")
sf.update(state="done")
"""


def test_polling_reader_never_sees_a_torn_document(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), "300"], env=runner_env(), cwd=REPO
    )
    reads = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if path.exists():
                got = read_status(path)
                assert got is not None, "a reader saw a document it could not parse"
                reads += 1
                if got.state == "done":
                    break
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0
    assert reads > 50
    assert not list(tmp_path.glob(".s.json.*.tmp")), "temp files left behind"


def test_report_writes_into_the_runners_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.json"
    assert report(step=1, loss=1.0) is False  # outside gpubot: a no-op
    monkeypatch.setenv(st.ENV_STATUS_FILE, str(path))
    StatusFile(path).reset(RunStatus(state="starting", precision="bf16"))
    assert report(step=5, loss=0.5, total_steps=10, accuracy=0.8, force=True)
    assert report(step=6, loss=0.4) is False  # rate-limited: kept pending
    st._reporter.flush()
    got = read_status(path)
    assert got is not None
    assert (got.state, got.step, got.loss, got.total_steps) == ("running", 6, 0.4, 10)
    assert got.metrics == {"accuracy": 0.8}
    assert got.precision == "bf16", "report must not erase the runner's fields"


def test_reading_status_needs_no_torch() -> None:
    """The bot reads the status format on hosts without torch."""
    probe = "import sys, training, training.status; assert 'torch' not in sys.modules"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=runner_env(), cwd=REPO, timeout=60, capture_output=True
    )
    assert done.returncode == 0, done.stderr


def test_report_counts_nan_losses_and_keeps_the_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN never reaches the file (JSON has none): it is counted and warned about, and
    the loss shown stays the last finite one; each write adds a point to the curve."""
    path = tmp_path / "s.json"
    monkeypatch.setenv(st.ENV_STATUS_FILE, str(path))
    StatusFile(path).reset(RunStatus(state="running"))
    report(step=1, loss=2.3, force=True)
    report(step=2, loss=float("nan"), force=True)
    report(step=3, loss=float("inf"), accuracy=0.5, force=True)
    got = read_status(path)
    assert got is not None
    assert (got.step, got.loss, got.nonfinite_losses) == (3, 2.3, 2)
    assert got.warnings == ["training.report got NaN or inf losses"]
    assert got.history == [{"step": 1.0, "loss": 2.3}, {"step": 3.0, "accuracy": 0.5}]


def test_the_curve_is_thinned_to_a_bound_and_keeps_both_ends() -> None:
    status = RunStatus()
    for step in range(1, 1001):
        st.add_history(status, step, 1.0 / step)
    assert len(status.history) <= st.HISTORY_POINTS
    assert status.history[0]["step"] == 1.0 and status.history[-1]["step"] == 1000.0
    steps = [p["step"] for p in status.history]
    assert steps == sorted(steps)


def test_the_writer_thread_applies_every_update_in_order(tmp_path: Path) -> None:
    """The runner's loop only queues; what it queued lands whole, in order, and `flush`
    returns once it is on disk. Updates queued during a write go out in the next one."""
    sf = StatusFile(tmp_path / "s.json")
    writer = st.StatusWriter(sf)
    writer.reset(RunStatus(state="running"))
    for step in range(1, 201):

        def point(s: RunStatus, step: int = step) -> None:
            st.add_history(s, step, 1.0 / step)
            s.nonfinite_losses += 1

        writer.update(point, step=step)
    writer.update(state="done")
    writer.flush()
    got = sf.read()
    assert got is not None
    assert (got.state, got.step, got.nonfinite_losses) == ("done", 200, 200)
    assert [p["step"] for p in got.history] == list(range(1, 201))
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.update(step=1)


def test_the_writer_thread_hands_its_errors_to_the_caller(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    writer = st.StatusWriter(StatusFile(blocker / "s.json"))
    with pytest.raises(TypeError, match="stpe"):
        writer.update(stpe=3)  # a typo fails in the caller's thread, at once
    writer.update(step=3)
    with pytest.raises(OSError):
        writer.flush()
    writer.close()

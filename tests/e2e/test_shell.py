"""`gpubot shell` end to end, as a subprocess with piped input: two users, one
slot, reserve / wait / release / grant with DM / status / expiry; and a kill -9
that must lose no granted reservation."""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e.shell_driver import ShellProcess, run_shell


def test_two_users_share_one_slot(tmp_path: Path) -> None:
    sh = ShellProcess(tmp_path)
    try:
        sh.send("/gpu reserve for 1h")
        sh.expect(r"^Reserved: reservation #1, CPU slot 0 on local")
        sh.expect(r'CUDA_VISIBLE_DEVICES=""')
        sh.send("@bob /gpu reserve for 3s")
        sh.expect(r"Reservation #2 is waiting \(you are first in line\)")
        sh.send("@bob /gpu status")
        sh.expect(r"0 of 1 free on 1 host; 1 waiting")
        sh.expect(r"0\s+cpu\s+alice \(#1\)")
        sh.expect(r"1\s+#2\s+bob")
        sh.send("@bob /gpu release 1")
        sh.expect(r"Reservation #1 is not yours")
        sh.send("/gpu release")
        sh.expect(r"^Done: #1 released\.")
        sh.expect(r"^\[dm @bob\] Your turn: granted: reservation #2")
        # bob's 3 s run out; the worker inside the shell ends it and tells him.
        sh.expect(r"^\[dm @bob\] Reservation #2 ended", timeout=30)
        sh.send("/gpu status")
        sh.expect(r"1 of 1 free on 1 host")
        sh.send("/gpu frobnicate")
        sh.expect(r"I don't know `frobnicate`")
        rc, err = sh.close()
    finally:
        if sh.proc.poll() is None:
            sh.kill()
    assert rc == 0
    assert "Traceback" not in "\n".join(sh.seen) + err


def test_kill_9_loses_no_granted_reservation(tmp_path: Path) -> None:
    first = ShellProcess(tmp_path)
    try:
        first.send("/gpu reserve for 2h")
        first.expect(r"^Reserved: reservation #1")
    finally:
        first.kill()  # SIGKILL: no clean-up runs
    proc = run_shell(tmp_path, "--user", "bob", script="/gpu status\n")
    assert proc.returncode == 0, proc.stderr
    assert "alice (#1)" in proc.stdout
    assert "0 of 1 free" in proc.stdout


def test_piped_script_runs_to_the_end_and_exits_zero(tmp_path: Path) -> None:
    script = "\n".join(
        [
            "# comments and blank lines are skipped",
            "",
            "/gpu help reserve",
            "@carol reserve",
            "@carol /gpu status me",
            "@carol /gpu extend 30m",
            "/gpu reserve 2 potato",
        ]
    )
    proc = run_shell(tmp_path, "--no-wait", script=script + "\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "/gpu reserve 2 a100 for 3h" in out  # help teaches with examples
    assert "Reserved: reservation #1" in out
    assert "Reservation #1 extended by 30m" in out
    assert "I don't know the GPU model `potato`" in out
    assert "Usage: /gpu reserve [COUNT] [MODEL] [for DURATION]" in out
    assert "Traceback" not in out + proc.stderr


def test_a_digits_run_queues_runs_and_dms_its_accuracy(tmp_path: Path) -> None:
    proc = run_shell(tmp_path, "--user", "alice", script="/gpu run --recipe digits\n/gpu queue\n")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Run #1 queued (next in line): recipe digits on 1 CPU slot" in out
    assert "[dm @alice] Run #1 started on local, CPU slot 0" in out
    m = re.search(
        r"\[dm @alice\] Run #1 \(recipe digits\) finished in \S+: test_accuracy (\d+\.\d+)%", out
    )
    assert m, out
    assert float(m.group(1)) >= 95.0
    # A CPU slot is not a GPU: its hours say so.
    assert "precision" in out and "CPU-slot hours" in out and "Health: no NaNs" in out
    assert "(attached: run-1-curve.png" in out


def test_digits_at_an_absurd_learning_rate_ends_with_a_warning_in_the_shell(
    tmp_path: Path,
) -> None:
    proc = run_shell(
        tmp_path, "--user", "alice", script="/gpu run --recipe digits --lr 100000 --epochs 2\n"
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "[dm @alice] ⚠️ Run #1 (recipe digits) finished" in out, out
    assert "but its training went wrong (the loss diverged)" in out
    assert "Do not trust this result" in out and "weights blew up" in out
    assert re.search(r"learning rate +100000", out), out

"""Static SSH hosts (GPUBOT_PROVIDER=ssh) against the real sshd hosts on 127.0.0.2/.3.

Listed from GPUBOT_SSH_HOSTS with the GPUs each entry declares, synced into host rows,
and reachable through the runtime's `HostAccess`; a host without declared GPUs is
probed with `training.inventory` over SSH, one that does not answer is `unreachable`.

A shortcut where a run or a preparation needs the bot's interpreter and code on the host:
those hosts log in as the bot's own user (the default lab), without a bootstrap; the tests
are about listing, syncing and reaching hosts. The probe of a host without a GPU list runs
on a stranger after a real bootstrap (the session's `bootstrapped` lab-a), with its venv.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlmodel import Session, select

from bot.app.config import ConfigError, load_settings
from bot.app.hosts.remote import PreparedHost, home_prepare
from bot.domain.commands import Logs, Reserve, Run, Status
from bot.faces.runtime import build_runtime
from db.models import Gpu, Host, TrainingRun
from provisioning import shell
from provisioning.hosts import (
    HostEntryError,
    StaticHostsCompute,
    parse_host_entries,
    probe_local_gpus,
)
from provisioning.hostshell import HostShell
from provisioning.ssh import SshClient, SshTarget
from tests.isolated_hosts import Bootstrapped
from tests.runtime_helpers import checked
from tests.ssh_hosts import SshLab


def test_entries_parse_names_users_ports_and_gpus() -> None:
    hosts = parse_host_entries(
        "box1=ubuntu@gpu1.lab.example:2200/4xA100, gpu2.lab.example/2xt4+1xa10g,  gpu@box3 ",
        default_user="root",
        normalize=lambda m: {"A100": "A100", "T4": "T4", "A10G": "A10G"}.get(m.upper()),
    )
    assert [h.name for h in hosts] == ["box1", "gpu2.lab.example", "box3"]
    assert hosts[0].target == SshTarget(
        host="gpu1.lab.example", port=2200, user="ubuntu", name="box1"
    )
    assert [g.model for g in hosts[0].gpus] == ["A100"] * 4
    assert [(g.index, g.model) for g in hosts[1].gpus] == [(0, "T4"), (1, "T4"), (2, "A10G")]
    assert hosts[1].target.user == "root" and hosts[1].target.port == 22
    assert hosts[2].gpus == () and hosts[2].target.user == "gpu"


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("a=/2xA100", "names no host"),
        ("a=h/fourxA100", "is not COUNTxMODEL"),
        ("a=h/0xA100", "declares no GPUs"),
        ("a=h1,a=h2", "used twice"),
    ],
)
def test_bad_entries_are_named(raw: str, words: str) -> None:
    with pytest.raises(HostEntryError, match=words):
        parse_host_entries(raw)


def _entry(lab: SshLab, name: str, gpus: str = "") -> str:
    host = lab.hosts[name]
    return f"{name}={lab.user_of(name)}@{host.address}:{host.port}" + (f"/{gpus}" if gpus else "")


@pytest.fixture
def env(ssh_lab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(ssh_lab.client_key))
    monkeypatch.setenv(
        "GPUBOT_SSH_HOSTS",
        ",".join([_entry(ssh_lab, "gpu-a", "2xA100"), _entry(ssh_lab, "gpu-b", "1xT4")]),
    )
    return tmp_path


@pytest.fixture
def client() -> Iterator[SshClient]:
    c = SshClient(connect_timeout=5, command_timeout=20)
    try:
        yield c
    finally:
        c.close()


def test_static_hosts_are_listed_synced_and_reachable(env: Path, client: SshClient) -> None:
    prepared: list[str] = []

    def prepare(runner: HostShell, target: SshTarget) -> PreparedHost:
        prepared.append(target.name)
        # Where a hand-prepared host keeps its runs; the test keeps them in its own tmp.
        assert home_prepare(runner, target).root.endswith("/.gpubot")
        return PreparedHost(root=str(env / "remote"), python=sys.executable)

    # No bootstrap (a shortcut on the bot's own loopback hosts): this test is about listing and reaching static hosts;
    # tests/provisioning/test_isolated_hosts.py bootstraps a real stranger.
    rt = build_runtime(load_settings(), ssh=client, prepare=prepare)
    assert isinstance(rt.compute, StaticHostsCompute)
    # Declared is not answered: nothing is grantable until the hosts' first checks reach
    # them (the worker runs them at start), and nothing was dialled to list them.
    snap = rt.service.status(rt.service.actor("alice"), Status())
    assert snap.view.text == "0 of 0 free on 0 hosts; 3 starting up"
    assert prepared == []
    checked(rt)
    snap = rt.service.status(rt.service.actor("alice"), Status())
    assert snap.view.text == "3 of 3 free on 2 hosts"
    # Owned, GPUs as declared, grantable once they answered.
    with Session(rt.engine) as s:
        rows = {h.name: h for h in s.exec(select(Host))}
        assert set(rows) == {"gpu-a", "gpu-b"}
        assert {h.provider for h in rows.values()} == {"ssh"}
        assert {h.market for h in rows.values()} == {"owned"}
        assert {h.state for h in rows.values()} == {"ready"}
        models = sorted(g.model for g in s.exec(select(Gpu).where(Gpu.host_id == rows["gpu-a"].id)))
        assert models == ["A100", "A100"]
    reply = rt.service.reserve(rt.service.actor("alice"), Reserve(1, "T4"))
    assert "gpu-b" in reply.view.text

    # Through the HostAccess the runs use: a command, a file written and read back.
    assert rt.service.runs is not None
    seat = rt.service.runs.access.runner_for("gpu-a")
    assert seat is not None
    runner, target, runs_dir = seat.runner, seat.target, seat.runs_dir
    assert target.host == "127.0.0.2" and target.name == "gpu-a"
    assert runner.run(target, "true", timeout=20).ok
    path = str(runs_dir / "probe.txt")
    runner.write_file(target, path, b"hello from gpu-a")
    assert runner.read_file(target, path) == b"hello from gpu-a"
    assert runs_dir == env / "remote" / "runs"
    # Prepared by their checks, once: a seat does not prepare again.
    assert rt.service.runs.access.runner_for("gpu-a") is not None
    assert sorted(prepared) == ["gpu-a", "gpu-b"]
    assert rt.service.runs.access.runner_for("no-such-host") is None
    rt.engine.dispose()


def test_hosts_without_declared_gpus_are_probed_and_dead_ones_marked(
    bootstrapped: Bootstrapped, client: SshClient
) -> None:
    """Not a shortcut: lab-a is a stranger (its own account) after a real bootstrap, and
    the probe runs with what that bootstrap left there, the host's venv and code."""
    lab, report = bootstrapped.lab, bootstrapped.report
    user = lab.user_of("lab-a")
    raw = ",".join([_entry(lab, "lab-a"), f"dead={user}@127.0.0.9:1/1xA100"])
    hosts = parse_host_entries(raw, key_path=str(lab.client_key))
    assert report.code_dir is not None
    command = (
        shell.cd(report.code_dir)
        + " && "
        + shell.join([report.venv_python, "-m", "training.inventory", "--json"])
    )
    compute = StaticHostsCompute(hosts, client, inventory_command=command)
    listed = {i.name: i for i in compute.list_instances()}
    assert listed["lab-a"].state == "ready"
    # lab-a is this machine's hardware underneath: the probe over SSH, as another account
    # with its own venv, sees what a local probe sees.
    assert listed["lab-a"].gpus == tuple(probe_local_gpus())
    # Declared GPUs are taken as configured; nothing is dialed for them.
    assert listed["dead"].state == "ready" and len(listed["dead"].gpus) == 1

    unreachable = StaticHostsCompute(
        parse_host_entries(f"gone={user}@127.0.0.9:1", key_path=str(lab.client_key)),
        client,
    )
    (gone,) = unreachable.list_instances()
    assert gone.state == "unreachable" and gone.gpus == ()


def test_provider_ssh_without_hosts_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", "")
    with pytest.raises(ConfigError, match="lists no hosts"):
        build_runtime(load_settings())
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", "a=h/nine×A100")
    with pytest.raises(ConfigError, match="COUNTxMODEL"):
        build_runtime(load_settings())


def test_a_training_run_goes_to_a_static_host_over_ssh(
    ssh_lab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: SshClient
) -> None:
    monkeypatch.setenv("GPUBOT_PROVIDER", "ssh")
    monkeypatch.setenv("GPUBOT_HOME", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("GPUBOT_SSH_KEY", str(ssh_lab.client_key))
    monkeypatch.setenv("GPUBOT_SSH_HOSTS", _entry(ssh_lab, "gpu-b", "1xcpu"))
    remote = PreparedHost(root=str(tmp_path / "remote"), python=sys.executable)
    # No bootstrap (a shortcut on the bot's own loopback hosts): this test is about listing and reaching static hosts;
    # tests/provisioning/test_isolated_hosts.py bootstraps a real stranger.
    rt = checked(build_runtime(load_settings(), ssh=client, prepare=lambda runner, target: remote))
    runs = rt.service.runs
    script = tmp_path / "train.py"
    script.write_text(
        "import socket, training\n"
        "training.report(step=1, loss=0.5)\n"
        "print('hello over ssh from', socket.gethostname())\n"
    )
    alice = rt.service.actor("alice")
    rid = runs.submit(alice, Run(command=(sys.executable, str(script)), model="cpu")).extra[
        "run_id"
    ]
    deadline = time.monotonic() + 120
    while True:
        runs.poll()
        runs.dispatch()
        with Session(rt.engine) as s:
            run = s.get(TrainingRun, rid)
            assert run is not None
            if run.state in ("succeeded", "failed"):
                break
        assert time.monotonic() < deadline, "the run did not finish"
        time.sleep(0.3)
    assert run.state == "succeeded", run.metrics
    assert run.placement["host"] == "gpu-b"
    # The run lived in the prepared root's runs/ on that host, and its log came back.
    assert run.placement["dir"] == f"{tmp_path}/remote/runs/{rid}"
    logs = runs.logs(alice, Logs(rid, 20))
    assert "hello over ssh from" in logs.view.text + str(logs.view.blocks)
    rt.engine.dispose()

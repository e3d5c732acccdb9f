"""Which partition, limit, account and node share a job asks a lab's Slurm for
(bot.providers.slurm.fit), on partitions and nodes as `scontrol show partition` and
`sinfo` give them. Pure: no cluster here; tests/provisioning/test_slurm_provider.py
runs the same choices against the real one."""

from __future__ import annotations

import pytest

from bot.domain.errors import UserError
from bot.providers.slurm.fit import Ask, Shares, choose
from provisioning.slurm_parse import Associations, SlurmNode, parse_partitions

# The test cluster's partitions as 22.05 prints them (tests/slurm_cluster.py).
PARTITIONS = parse_partitions(
    "PartitionName=short AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL Default=YES QoS=N/A "
    "DefaultTime=00:10:00 GraceTime=10 MaxTime=00:30:00 Nodes=n1 PriorityTier=1 "
    "PreemptMode=REQUEUE State=UP JobDefaults=(null)\n"
    "PartitionName=long AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL Default=NO QoS=N/A "
    "DefaultTime=01:00:00 MaxTime=2-00:00:00 Nodes=n1 PriorityTier=1 PreemptMode=REQUEUE "
    "State=UP JobDefaults=(null)\n"
    "PartitionName=urgent AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL Default=NO QoS=N/A "
    "DefaultTime=NONE MaxTime=01:00:00 Nodes=n1 PriorityTier=10 PreemptMode=OFF State=UP "
    "JobDefaults=(null)\n"
)
NODE = SlurmNode(
    name="n1",
    state="idle",
    raw_state="IDLE",
    reason="",
    partitions=("short", "long", "urgent"),
    gpus={"A100": 4},
    gres_types={"A100": "a100"},
    cpus=8,
    memory_mb=2000,
)
ALICE = Associations(
    accounts=("lab", "vision"), default_account="lab", qos=("normal",), default_qos="normal"
)


def fit(ask: Ask, **kw: object) -> object:
    return choose(ask, PARTITIONS, [NODE], **kw)  # type: ignore[arg-type]


def test_a_short_request_takes_the_default_partition_and_a_nodes_share_per_gpu() -> None:
    got = choose(Ask(gpus=1, model="A100", seconds=20 * 60), PARTITIONS, [NODE])
    assert (got.partition, got.time_limit_s, got.defaulted) == ("short", 1200, False)
    # 8 CPUs and 2000 MB over 4 GPUs: a 1-GPU job leaves room for three more.
    assert (got.cpus_per_gpu, got.mem_per_gpu_mb) == (2, 500)


def test_a_longer_request_goes_where_it_is_allowed_never_to_a_preempting_tier() -> None:
    two_hours = choose(Ask(gpus=1, model="A100", seconds=7200), PARTITIONS, [NODE])
    assert two_hours.partition == "long"
    # 45 minutes fits urgent (1h) and long: urgent would preempt others' jobs.
    assert choose(Ask(gpus=1, model="A100", seconds=2700), PARTITIONS, [NODE]).partition == "long"
    asked = choose(Ask(1, "A100", 2700, partition="urgent"), PARTITIONS, [NODE])
    assert asked.partition == "urgent"


def test_no_length_takes_the_default_partitions_default_time() -> None:
    got = choose(Ask(gpus=1, model="A100", seconds=None), PARTITIONS, [NODE])
    assert (got.partition, got.time_limit_s, got.defaulted) == ("short", 600, True)


def test_a_request_no_partition_allows_is_refused_with_the_longest() -> None:
    with pytest.raises(UserError) as refused:
        choose(Ask(gpus=1, model="A100", seconds=3 * 86400), PARTITIONS, [NODE])
    assert "the longest allowed is 2d" in refused.value.text
    assert "`long`" in refused.value.text
    with pytest.raises(UserError, match="the longest allowed is 30m"):
        choose(Ask(1, "A100", 3600, partition="short"), PARTITIONS, [NODE])


def test_gpus_the_cluster_lacks_are_said_with_what_it_has() -> None:
    with pytest.raises(UserError, match=r"has no H100 GPUs \(it has: A100\)"):
        choose(Ask(gpus=1, model="H100", seconds=600), PARTITIONS, [NODE])
    with pytest.raises(UserError, match=r"no node with 8 A100 GPUs \(the most on one node is 4\)"):
        choose(Ask(gpus=8, model="A100", seconds=600), PARTITIONS, [NODE])
    with pytest.raises(
        UserError, match="no partition `gpu` to use; the partitions: short, long, urgent"
    ):
        choose(Ask(1, "A100", 600, partition="gpu"), PARTITIONS, [NODE])


def test_accounts_and_qos_are_checked_against_accounting() -> None:
    ok = choose(Ask(1, "A100", 600, account="vision"), PARTITIONS, [NODE], assoc=ALICE)
    assert ok.account == "vision"
    with pytest.raises(UserError, match=r"may not use Slurm account `physics`; yours: lab, vision"):
        choose(Ask(1, "A100", 600, account="physics"), PARTITIONS, [NODE], assoc=ALICE)
    with pytest.raises(UserError, match=r"may not use QOS `high`; yours: normal"):
        choose(Ask(1, "A100", 600, qos="high"), PARTITIONS, [NODE], assoc=ALICE)
    # A QOS's MaxWall caps the partition's.
    with pytest.raises(UserError, match="the longest allowed is 20m"):
        choose(Ask(1, "A100", 1500), PARTITIONS, [NODE], assoc=ALICE, walls={"normal": 1200})


def test_a_partitions_own_defaults_and_the_admins_settings_win_over_the_share() -> None:
    with_defaults = parse_partitions(
        "PartitionName=p Default=YES MaxTime=UNLIMITED DefaultTime=NONE Nodes=n1 State=UP "
        "JobDefaults=DefCpuPerGPU=3,DefMemPerGPU=700"
    )
    node = SlurmNode(**{**NODE.__dict__, "partitions": ("p",)})
    got = choose(Ask(1, "A100", None), with_defaults, [node])
    assert (got.cpus_per_gpu, got.mem_per_gpu_mb) == (None, None)  # Slurm applies its own
    assert got.max_time_s is None and got.time_limit_s == 24 * 3600
    mine = choose(Ask(1, "A100", 600), PARTITIONS, [NODE], shares=Shares(4, 1024))
    assert (mine.cpus_per_gpu, mine.mem_per_gpu_mb) == (4, 1024)

"""The runner's command line: what every executor starts on a run's host (or in its batch
job) for one run, `python -m training.runner` with the run's settings."""

from __future__ import annotations

from typing import Any

from bot.app.hosts import sources
from db.models import TrainingRun
from provisioning import shell


def _oom_batch(run: TrainingRun) -> tuple[int | None, bool]:
    """(batch size, is a retry) for a run retried after running out of GPU memory."""
    retry = run.metrics.get("oom_retry")
    if not isinstance(retry, dict):
        return None, False
    size = retry.get("batch_size")
    return (size if isinstance(size, int) and size > 0 else None), True


def runner_command(
    run: TrainingRun,
    placement: dict[str, Any],
    python: str,
    *,
    across: tuple[int, int, str] | None = None,
    per_node: int | None = None,
) -> str:
    """The runner's line, started with `python`: the host's interpreter (HostSeat).

    `across`: (nodes, this node's rank, rendezvous HOST:PORT) for one host's part of a
    run over several; `placement` is then that node's, and `--gpus` its share.
    `per_node`: `--gpus` for a line whose node's place a launcher adds on each node
    (training.across_nodes, a Slurm job over several nodes)."""
    batch, retried = _oom_batch(run)
    parts = [
        python,
        "-m",
        "training.runner",
        "--precision",
        run.precision,
        "--status-file",
        placement["status"],
        "--checkpoint-dir",
        placement["checkpoints"],
        "--run-id",
        str(run.id),
    ]
    if run.max_seconds:
        parts += ["--max-minutes", f"{run.max_seconds / 60:.2f}"]
    if per_node is None:
        per_node = run.gpu_count if across is None else len(placement["gpu_indexes"])
    if per_node > 1:
        parts += ["--gpus", str(per_node)]
    if across is not None:
        nodes, rank, endpoint = across
        parts += ["--nnodes", str(nodes), "--node-rank", str(rank), "--rdzv-endpoint", endpoint]
    if run.recipe:
        parts += ["--recipe", run.recipe]
        for name in ("lr", "epochs"):  # the recipe's settings as asked (bot.domain.commands)
            if isinstance(run.options.get(name), int | float):
                parts += [f"--{name}", f"{run.options[name]:g}"]
        asked = run.options.get("batch-size")
        if batch is not None:  # an OOM retry; without a known batch `auto` probes again
            parts += ["--batch-size", str(batch)]
        elif isinstance(asked, int | float):
            parts += ["--batch-size", str(int(asked))]
        return shell.join(parts)
    head = ""
    if retried:
        # The runner hands its own --batch-size to recipes only; a script reads these.
        env = {"GPUBOT_OOM_RETRY": "1", "GPUBOT_BATCH_SCALE": "0.5"}
        if batch is not None:
            env["GPUBOT_BATCH_SIZE"] = str(batch)
        head += shell.env_prefix(env)
    if run.source:  # bot.app.hosts.sources: the command starts in its code directory
        head += sources.in_code_dir(run.source, placement["dir"]) + " "
    # run.command is the owner's own shell text (`command_text`), run as they typed it.
    return shell.join(parts) + " -- " + head + run.command

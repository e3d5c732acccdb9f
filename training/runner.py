"""``python -m training.runner``: one training run on a GPU host, as the bot starts it.

See ``python -m training.runner --help`` for the command line; `training.exitcodes` for
what the exit status means; `training.status` for the status file the bot reads.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

from training.exitcodes import (
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_TIME_LIMIT,
    EXIT_USAGE,
)
from training.status import (
    ENV_CHECKPOINT_DIR,
    ENV_PRECISION,
    ENV_PRECISION_REASON,
    ENV_STATUS_FILE,
    RunStatus,
)

DESCRIPTION = """\
Run one training run: a built-in recipe, or your own command.

  python -m training.runner --recipe digits --status-file run/status.json
  python -m training.runner --checkpoint-dir ckpt --status-file s.json -- python train.py --lr 3e-4
  python -m training.runner --gpus 4 --recipe digits            # DDP under torchrun

Precision (--precision auto): bf16 autocast on GPUs with fast bf16 (Ampere, Hopper and
later), fp16 autocast + GradScaler on Volta/Turing, fp32 where mixed precision would be
slower (older GPUs, CPUs without AMX). The choice and its reason go to the status file.

Your own command runs in its own process group with these variables set:
  GPUBOT_PRECISION       bf16 | fp16 | fp32, what auto chose (or what you asked for)
  GPUBOT_STATUS_FILE     where training.report(step=..., loss=..., accuracy=...) writes
  GPUBOT_CHECKPOINT_DIR  where to keep your checkpoints (training.save_checkpoint)
In the script:
  import training
  scaler = training.grad_scaler()          # live only for fp16
  with training.autocast_context():
      loss = model(x)
  scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
  training.report(step=step, loss=loss.item())
SIGTERM is forwarded to it; save a checkpoint and exit 75 to say "resume me".
"""

EPILOG = f"""\
exit codes (training/exitcodes.py):
  {EXIT_DONE}   done                  {EXIT_FAILED}   failed              {EXIT_USAGE}   bad command line
  {EXIT_PREEMPTED}  stopped by SIGTERM after a checkpoint: run the same command to resume
  {EXIT_TIME_LIMIT}  --max-minutes reached after a checkpoint: run the same command to resume
  {EXIT_OOM}  out of GPU memory (even at the smallest batch)

Resuming: start the same command with the same --checkpoint-dir; a recipe continues from
the checkpointed step (same data order, same RNG streams).
"""


def _batch_size(text: str) -> int | None:
    if text == "auto":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("batch size must be a positive integer or 'auto'")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.runner",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] (--recipe NAME | -- COMMAND ...)",
    )
    what = parser.add_argument_group("what to run")
    what.add_argument(
        "--recipe",
        metavar="NAME",
        help="a built-in recipe: digits (an MLP on scikit-learn's bundled digits, no download)",
    )
    what.add_argument(
        "command",
        nargs="*",
        metavar="COMMAND",
        help="after --: your own command, e.g. -- python train.py --epochs 3",
    )

    prec = parser.add_argument_group("precision")
    prec.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="autocast dtype; auto picks the fastest safe one for the device (default: auto)",
    )

    batch = parser.add_argument_group("batch size and learning rate (recipes)")
    batch.add_argument(
        "--batch-size",
        type=_batch_size,
        default=None,
        metavar="N|auto",
        help="per-GPU micro-batch; auto (default) finds the largest that fits in GPU memory "
        "(double, then bisect on out-of-memory), on CPU the recipe's reference batch",
    )
    batch.add_argument(
        "--effective-batch",
        type=_positive_int,
        metavar="N",
        help="samples per optimizer step, all GPUs together; reached with gradient "
        "accumulation when the micro-batch is smaller",
    )
    batch.add_argument(
        "--lr",
        type=_positive_float,
        metavar="LR",
        help="learning rate at the recipe's reference batch (digits: 1e-3 at 64); scaled "
        "linearly to the effective batch",
    )
    batch.add_argument("--epochs", type=_positive_int, metavar="N", help="default: the recipe's")
    batch.add_argument("--seed", type=int, default=0, help="seed for init and data order")

    where = parser.add_argument_group("devices")
    where.add_argument(
        "--gpus",
        type=_positive_int,
        default=1,
        metavar="N",
        help="processes on this host; N > 1 runs under torchrun with DDP (NCCL on GPUs, "
        "gloo CPU processes where there is no GPU)",
    )
    where.add_argument("--nnodes", type=_positive_int, default=1, help="hosts in a multi-host run")
    where.add_argument("--node-rank", type=int, default=0, help="this host's rank (0..nnodes-1)")
    where.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="rendezvous on node 0, reachable from all hosts (needed with --nnodes > 1)",
    )
    where.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="auto (default): cuda where there is a GPU, else cpu",
    )

    run = parser.add_argument_group("status, checkpoints, limits")
    run.add_argument("--run-id", help="a name for the run, echoed in the status file")
    run.add_argument(
        "--status-file",
        type=Path,
        metavar="PATH",
        help="JSON status document, replaced atomically (see training/status.py)",
    )
    run.add_argument(
        "--status-every",
        type=_positive_float,
        default=2.0,
        metavar="SECONDS",
        help="how often a recipe rewrites the status file (default: 2)",
    )
    run.add_argument(
        "--checkpoint-dir",
        type=Path,
        metavar="DIR",
        help="where checkpoints go; a run started again with the same dir resumes",
    )
    run.add_argument(
        "--checkpoint-every",
        type=_positive_float,
        default=10.0,
        metavar="MINUTES",
        help="checkpoint interval (default: 10); SIGTERM always checkpoints first",
    )
    run.add_argument(
        "--max-minutes",
        type=_positive_float,
        metavar="MINUTES",
        help=f"stop at this wall time with a checkpoint and exit {EXIT_TIME_LIMIT}",
    )
    run.add_argument("--quiet", action="store_true", help="no progress lines on stdout")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1 :]
    else:
        own, command = argv, []
    args = parser.parse_args(own)
    if args.command:
        parser.error(f"unexpected arguments {args.command}; put your command after --")
    args.command = command
    if bool(args.recipe) == bool(command):
        parser.error("give either --recipe NAME or -- COMMAND (exactly one)")
    if args.recipe is not None:
        from training.recipes import RECIPES

        if args.recipe not in RECIPES:
            parser.error(f"unknown recipe {args.recipe!r}; known: {', '.join(sorted(RECIPES))}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        parser.error("--nnodes > 1 needs --rdzv-endpoint HOST:PORT of node 0")
    if args.rdzv_endpoint and not args.rdzv_endpoint.rpartition(":")[2].isdigit():
        parser.error("--rdzv-endpoint must be HOST:PORT")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error("--node-rank must be in 0..nnodes-1")
    return args


def _strip_launch_options(argv: list[str]) -> list[str]:
    """The argv for a torchrun worker: the same run, without the options torchrun consumed."""
    drop_with_value = {"--gpus", "--nnodes", "--node-rank", "--rdzv-endpoint"}
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop_with_value:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _run_recipe(args: argparse.Namespace) -> int:
    from training.loop import TrainConfig, train

    result = train(
        TrainConfig(
            recipe=args.recipe,
            precision=args.precision,
            batch_size=args.batch_size,
            effective_batch=args.effective_batch,
            lr=args.lr,
            epochs=args.epochs,
            seed=args.seed,
            device=args.device,
            status_file=args.status_file,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every_min=args.checkpoint_every,
            max_minutes=args.max_minutes,
            status_every_s=args.status_every,
            run_id=args.run_id,
            verbose=not args.quiet,
        )
    )
    return result.exit_code


def _child_env(args: argparse.Namespace, precision: str, reason: str) -> dict[str, str]:
    env = dict(os.environ)
    env[ENV_PRECISION] = precision
    env[ENV_PRECISION_REASON] = reason
    if args.status_file is not None:
        env[ENV_STATUS_FILE] = str(args.status_file.resolve())
    if args.checkpoint_dir is not None:
        args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        env[ENV_CHECKPOINT_DIR] = str(args.checkpoint_dir.resolve())
    # The child must find this package even when started from elsewhere.
    here = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.nnodes > 1:
        from training.launching import interface_towards

        host, _, port = str(args.rdzv_endpoint).rpartition(":")
        interface = interface_towards(host.strip("[]"), int(port))
        if interface is not None:  # what the team set wins (setdefault)
            env.setdefault("GLOO_SOCKET_IFNAME", interface)
            env.setdefault("NCCL_SOCKET_IFNAME", interface)
    return env


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Supervise a child: the user's command, or torchrun for several processes."""
    # No torch here: this process supervises the whole run (training.launching).
    from training.launching import probe_precision, torchrun_command
    from training.supervise import SupervisorConfig, supervise

    choice = probe_precision(args.precision, args.device)
    world = args.gpus * args.nnodes
    rdzv_id = args.run_id or f"gpubot-{uuid.uuid4().hex[:8]}"
    kind = "recipe" if args.recipe else "command"
    if args.recipe:
        cmd = torchrun_command(
            args.gpus,
            ["training.runner", *_strip_launch_options(argv)],
            module=True,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=rdzv_id,
        )
    elif world > 1:
        cmd = torchrun_command(
            args.gpus,
            args.command,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=rdzv_id,
        )
    else:
        cmd = list(args.command)
    env = _child_env(args, choice.precision, choice.reason)
    if not args.quiet:
        print(f"[gpubot] precision {choice.precision}: {choice.reason}", flush=True)
    initial = RunStatus(
        state="running" if kind == "command" else "starting",
        run_id=args.run_id,
        kind=kind,
        recipe=args.recipe,
        command=list(args.command) if args.command else None,
        precision=choice.precision,
        precision_reason=choice.reason,
        world_size=world,
        device=choice.device,
    )
    recipe_mode = bool(args.recipe)
    return supervise(
        cmd,
        env=env,
        status_path=args.status_file,
        initial=initial,
        config=SupervisorConfig(
            # A recipe enforces --max-minutes itself (with a checkpoint); a user command
            # is told by SIGTERM at the limit.
            max_minutes=None if recipe_mode else args.max_minutes,
            child_owns_state=recipe_mode,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from training.launching import under_torchrun

    if args.recipe and (under_torchrun() or args.gpus * args.nnodes == 1):
        return _run_recipe(args)
    return _launch(args, argv)


if __name__ == "__main__":
    code = main()
    # The run is over: its status (and a recipe's checkpoint) is on disk and its output
    # is flushed below. Leaving through os._exit skips the interpreter's teardown of
    # torch (about a second on a loaded machine), so the bot, which watches for this
    # process to end, learns of the end that much sooner.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

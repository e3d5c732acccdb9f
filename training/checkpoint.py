"""Atomic checkpoints, so a spot interruption or a cancel never costs more than N minutes.

A checkpoint is one file, ``latest.pt`` in the checkpoint dir, written to a temporary
file beside it, fsynced and renamed over the old one: a kill at any moment leaves either
the previous checkpoint or the new one, never a torn file that would fail the resume.
It holds model, optimizer and GradScaler state, the step and epoch, and every RNG state
(Python, torch CPU, CUDA), so a resumed run continues the same random streams.

User scripts can use `save_checkpoint` / `load_checkpoint` with ``GPUBOT_CHECKPOINT_DIR``.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Final

import torch

CHECKPOINT_NAME: Final = "latest.pt"
FORMAT_VERSION: Final = 1


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])


def _umask() -> int:
    """This process's umask, read without setting it where Linux says it (setting it,
    even back, races with other threads creating files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def checkpoint_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / CHECKPOINT_NAME


def save_checkpoint(directory: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write `state` (plus the RNG states) atomically; returns the checkpoint's path."""
    target = checkpoint_path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format_version": FORMAT_VERSION, "rng": rng_state(), **state}
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        # mkstemp makes it 0600: give it the mode any file of this process gets (the
        # umask's), so that whoever may read the directory's files may read this one
        # (a cluster's bot account, through the work directory's group).
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return target


def load_checkpoint(
    directory: str | os.PathLike[str] | None,
    map_location: str | torch.device = "cpu",
    restore_rng: bool = True,
) -> dict[str, Any] | None:
    """The latest checkpoint in `directory`, or None if there is none (a fresh start).

    Loaded with ``weights_only=True``: a checkpoint dir can be shared, and unpickling
    arbitrary objects from it would run arbitrary code.
    """
    if directory is None:
        return None
    path = checkpoint_path(directory)
    if not path.exists():
        return None
    state: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=True)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {state.get('format_version')!r} unknown")
    if restore_rng and "rng" in state:
        restore_rng_state(state["rng"])
    return state

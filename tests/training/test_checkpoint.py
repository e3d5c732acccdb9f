"""Checkpoints: atomic, complete, and restoring the random streams."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import nn

from training.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint


def test_round_trip_restores_state_and_rng(tmp_path: Path) -> None:
    torch.manual_seed(1)
    random.seed(1)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.autograd.backward(model(torch.randn(4, 3)).sum())
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    save_checkpoint(
        tmp_path,
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict(),
            "step": 7,
        },
    )
    expected = (torch.rand(3), random.random())
    torch.rand(100)  # move the streams on, as training would
    random.random()

    state = load_checkpoint(tmp_path)
    assert state is not None and state["step"] == 7
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    fresh = nn.Linear(3, 2)
    fresh.load_state_dict(state["model"])
    assert torch.equal(fresh.weight, model.weight)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_opt.load_state_dict(state["optimizer"])
    assert torch.equal(
        fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    assert state["scaler"]["scale"] == 128.0
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]


def test_no_checkpoint_means_fresh_start(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path) is None
    assert load_checkpoint(None) is None


def test_a_checkpoint_gets_the_umasks_mode_not_mkstemps(tmp_path: Path) -> None:
    """On a cluster the job (its owner's account) writes it and the bot account, in the
    work directory's group, copies it off: 0600 would shut the bot out."""
    import os
    import stat

    old = os.umask(0o027)
    try:
        path = save_checkpoint(tmp_path, {"step": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640

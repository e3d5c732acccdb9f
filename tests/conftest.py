"""Suite-wide markers: `gpu` tests skip where CUDA is absent, `postgres` ones where the server is."""

from __future__ import annotations

import socket

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _postgres_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=0.5):
            return True
    except OSError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = None
    postgres = None
    for item in items:
        if "gpu" in item.keywords:
            if cuda is None:
                cuda = _cuda_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA"))
        if "postgres" in item.keywords:
            if postgres is None:
                postgres = _postgres_reachable()
            if not postgres:
                item.add_marker(pytest.mark.skip(reason="PostgreSQL not reachable at 127.0.0.1:5432"))

"""The benchmarks (`make bench`, `python -m bench`): one module each, and what they share."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """The process's environment with `values` set, as the bot reads its settings from it
    (`load_settings`, `build_runtime`), put back as it was afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

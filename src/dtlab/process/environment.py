"""Environment variables set for a while: the process's own values (or their absence) return."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def variables_set(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ inside the block; afterwards each variable as it was before."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

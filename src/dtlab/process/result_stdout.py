"""Standard output that holds a command's result and nothing else, for `--json`.

Libraries write to standard output on their own: DeepSpeed's logger prints its accelerator line
to stdout on import, and processes a command starts (the doctor's smoke ranks, the co-running
ranks of `dtlab predict --measure`, the runs of `--validate`) inherit its descriptor. Piped into
`jq` or `json.load`, one such line breaks the whole answer. While a `--json` command works, file
descriptor 1 and `sys.stdout` point at standard error, so that whatever anyone prints is still
seen, where a log belongs; `print_result` alone writes to the real standard output.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO

# While a command keeps stdout for its result: the real standard output's descriptor, and the
# `sys.stdout` of before (the real one, or a test's capture)
_kept: tuple[int, TextIO] | None = None


@contextlib.contextmanager
def stdout_kept_for_result(keep: bool = True) -> Iterator[None]:
    """Inside: output to stdout (Python's and any descriptor 1 a child inherits) goes to stderr,
    but `print_result`'s. `keep=False`: no change (a table's own progress lines belong on
    stdout)."""
    global _kept
    if not keep or _kept is not None:
        yield
        return
    sys.stdout.flush()
    _kept = (os.dup(1), sys.stdout)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        fd, out = _kept
        with contextlib.suppress(Exception):
            out.flush()
        os.dup2(fd, 1)
        os.close(fd)
        _kept = None


def print_result(text: str) -> None:
    """`text` and a newline on the real standard output, inside or outside the block above."""
    if _kept is None:
        print(text, flush=True)
        return
    fd, out = _kept
    out.flush()  # what a library left in its buffer belongs to stderr, where fd 1 points now
    os.dup2(fd, 1)
    try:
        print(text, file=out, flush=True)
    finally:
        os.dup2(2, 1)

"""Standard output that holds a command's result and nothing else, for `--json`.

Libraries write to standard output on their own: DeepSpeed's logger prints its accelerator line
to stdout on import, and processes a command starts (the co-running ranks of `dtlab predict
--measure`) inherit its descriptor. Piped into `jq` or `json.load`, one such line breaks the whole
answer. While the command works, file descriptor 1 and `sys.stdout` point at standard error, so
that whatever anyone prints is still seen, where a log belongs; the result is printed after.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def stdout_kept_for_result(keep: bool = True) -> Iterator[None]:
    """Inside: output to stdout (Python's and any descriptor 1 a child inherits) goes to stderr.
    After: stdout as it was, for the result. `keep=False`: no change (a table's own progress
    lines belong on stdout)."""
    if not keep:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)

"""The `dtlab` command and `python -m dtlab`: stop signals are handled first
(process/early_exit.py), then the command line's imports (pydantic, the config schema, later
torch) start: a Ctrl-C among them would print a KeyboardInterrupt traceback."""

from __future__ import annotations

from dtlab.process.early_exit import TYPE_CHECKING, exit_on_signals

if TYPE_CHECKING:
    from typing import NoReturn


def entry() -> NoReturn:
    exit_on_signals()  # until the CLI handles them: a signal during its imports ends it at once
    from dtlab.cli.main import entry as cli

    cli()


if __name__ == "__main__":
    entry()

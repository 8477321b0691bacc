from dtlab.early_exit import exit_on_signals

exit_on_signals()  # until the CLI handles them: a signal during its imports ends it at once

from dtlab.cli import entry  # noqa: E402

entry()

from dtlab.process.early_exit import exit_on_signals

exit_on_signals()  # until the CLI handles them: a signal during its imports ends it at once

from dtlab.cli.main import entry  # noqa: E402

entry()

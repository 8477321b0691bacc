from dtlab import interrupt

interrupt.exit_on_signals()  # until the CLI handles them: a signal during its imports ends it quietly

from dtlab.cli import entry  # noqa: E402

entry()

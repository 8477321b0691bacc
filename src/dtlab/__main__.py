from dtlab.cli import entry

entry()

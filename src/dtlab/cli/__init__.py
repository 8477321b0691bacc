"""The `dtlab` command line, on top of everything: `main.py` parses the arguments and hands each
command to its package (train, compare, sweep, results, estimate, comm, doctor, text);
`compare.py` is `dtlab compare` (one config, several strategies, one table).

May import every other package; nothing imports it (`python -m dtlab` and the console script do).
"""

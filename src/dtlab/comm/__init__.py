"""`dtlab comm`: collective benchmarks in nccl-tests' format (`bench.py`, the collectives in
`ops.py`), the fitted cost model (`model.py`), their tables and files (`output.py`) and the
command's arguments (`cli.py`).

Beside the results, under the commands: may import the loop's parts and every layer below
(it uses process control, the instruments' load check and the ground); never a command.
"""

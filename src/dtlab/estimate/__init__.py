"""`dtlab estimate` and `dtlab advise`: per-rank memory and communication of a training setup,
by arithmetic, before running it.

memory.py       the per-rank bytes of the training state per strategy (the ZeRO accounting)
layout.py       the exact bytes of a real dtlab model under each wrapper's sharding rules
activations.py  what each model family saves for backward, and the peak during backward
comm.py         communication volume per step and its predicted time
core.py         one estimate: a model, a setup and a strategy -> one row of numbers
advise.py       which strategy fits a given device memory, and the headroom left
measure.py      measuring saved tensors and peak memory, to check activations.py against
cli.py          the two commands' arguments and output
"""

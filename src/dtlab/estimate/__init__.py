"""`dtlab estimate` and `dtlab advise`: per-rank memory and communication of a training setup.

Measured: the state bytes of dtlab's torch strategies on a config's model (single, ddp, fsdp,
fsdp1, zero1, tp, fsdp_tp, pp), by running dtlab's own strategy class under torch's fake
process-group backend in this process, any world size. Modelled: DeepSpeed's state (its layout,
to the byte, in strategies/deepspeed_memory.py), the ideal ZeRO layouts (--n-params,
zero2/zero3/hybrid), activations, temporaries, communication.

measure.py         the fake-backend measurement
memory.py          the per-rank bytes of the ideal layouts (the ZeRO paper's accounting)
activations.py     what each model family saves for backward, and the peak during backward
comm.py            communication volume per step and its predicted time
core.py            one estimate: a model, a setup and a strategy -> one row of numbers
advise.py, cli.py  which strategy fits a given device memory; the commands' arguments and output

A command: may import every layer below the commands (strategies, models, data, levers, config,
comm's cost model and the ground); never another command.
"""

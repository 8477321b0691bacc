"""A training run and its state: one step (`step.py`), what a run is made of (`run_state.py`),
its checkpoints and resume (`checkpoint.py`, `state.py`, `save_failure.py`), stopping at a step
boundary (`stop.py`), the run directory's owner (`owner.py`), injected faults (`faults.py`), the
sweep record it updates (`sweep_record.py`) and what it reports (`summary.py`).

The loop (`dtlab/train.py`) drives these parts. May import the instruments, strategies, models,
data, levers, config, process control and the ground; never the loop or the commands.
"""

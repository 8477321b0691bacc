"""Instruments that observe a run without changing it: metrics and memory (`metrics.py`), FLOPs
and MFU (`flops.py`), the machine's load (`machine_load.py`), the profiler window
(`profile_window.py`), the compute/communication breakdown (`breakdown.py`), CUDA memory
snapshots (`memory_snapshot.py`) and the flight recorder (`flight_recorder.py`).

May import strategies, models, data, levers, config, process control and the ground; never the run,
the loop or the commands.
"""

"""How dtlab's processes start and stop: the first thing each does (`early_exit.py`), stopping on a
signal (`interrupt.py`), dying with the launcher that started it (`launcher_guard.py`), and
starting local workers through torch elastic (`launch.py`).

May import only the ground: `dtlab.errors`, `dtlab.files`, `dtlab.distributed`.
"""

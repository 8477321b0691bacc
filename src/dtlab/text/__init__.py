"""Language-model tools around runs: text -> token files (`prepare.py`, `tokenizer.py`), a trained
model -> text (`sample.py`), a checkpoint -> model files (`export.py`), and their command-line
arguments (`cli.py`).

May import the run's checkpoints, models, data, levers, config and the ground; never the loop or
the other commands.
"""

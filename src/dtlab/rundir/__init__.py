"""The run directory's layout, read by every layer that names a run's files: where the
checkpoints live and which are complete (`checkpoints.py`), and the hints that say, true when
followed, which checkpoint a rerun continues from or how to start over (`hints.py`).

Below the strategies, instruments and the run, which all read it (DeepSpeed's resume check, a
failed metrics write, a failed save). Torch-free; may import only the ground (`dtlab.errors`,
`dtlab.files`), never config or anything above it.
"""

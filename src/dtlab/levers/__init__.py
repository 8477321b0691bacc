"""Levers: what changes how a model trains, applied before a strategy wraps it or built by one:
activation checkpointing, torch.compile, numerics (TF32, determinism), the optimizer and its
schedule (`optim.py`), LoRA adapters (`lora.py`).

May import only config and the ground (errors, files, distributed); models and strategies use them.
"""

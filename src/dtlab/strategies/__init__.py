"""Strategies: a description of each (`<name>_spec.py`, torch-free) and its implementation
(`<name>.py`, behind the interface in `base.py`), listed once in `registry.py`.

Implementations are imported when a run builds one: a DDP worker does not pay for importing
DTensor, pipelining (which pulls in torch._dynamo) or DeepSpeed, about 1.5 s per process on our CI
machine; and reading or checking a config imports no torch at all.
"""

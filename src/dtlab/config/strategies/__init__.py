"""What dtlab knows about each strategy without running it, torch-free: its description
(`<name>_spec.py`: its config section, checks, labels, cost model; `spec.py` holds the shared
type) and the registry listing them (`registry.py`). The implementation of each is
`dtlab/strategies/<name>.py`, named by its description's `impl`.

Part of the config layer (the schema is built from these): may import `dtlab.config.options`,
`dtlab.config.world` and the ground; never models, data, strategies' implementations or above.
"""

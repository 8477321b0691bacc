"""What dtlab knows about each strategy without running it, torch-free: its description
(`<name>_spec.py`: its config section, checks, labels, cost model; `spec.py` holds the shared
type) and the registry listing them (`registry.py`). The implementation of each is
`dtlab/strategies/<name>.py`, named by its description's `impl`.

Part of the config layer (the schema is built from these): may import `dtlab.config.options`,
`dtlab.config.device` and the ground; never the schema, `dtlab.config.world` (which asks the
registry), models, data, strategies' implementations or above. The registry names each
implementation; `dtlab.strategies.build` imports it (docs/architecture.md, "Import rules").
"""

"""`single`: one process, no wrapper; the reference every other strategy is checked against."""

from dtlab.config.strategies.spec import StrategySpec

SPEC = StrategySpec(
    name="single", impl="single:Single", about="one process, no wrapper (the reference)",
    one_process=True, textbook="ddp",
)

"""The base of every config section: unknown keys are refused, assignments validated.

Its own module (torch- and dtlab-free) because the strategies' option sections, declared beside
each strategy in `dtlab/strategies/*_spec.py`, and the schema in `dtlab/config/schema.py` both
build on it, and the schema assembles `strategy.*` from those descriptions.
"""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

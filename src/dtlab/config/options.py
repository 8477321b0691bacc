"""The base of every config section: unknown keys are refused, assignments validated; and the
type of every setting that names a file or directory (`UserPath`).

Its own module (torch- and dtlab-free) because the strategies' option sections, declared beside
each strategy in `dtlab/strategies/*_spec.py`, and the schema in `dtlab/config/schema.py` both
build on it, and the schema assembles `strategy.*` from those descriptions.
"""

import os
import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator


def _numeric(annotation: Any) -> bool:
    """A number type (int, float, their constrained and optional forms): pydantic would read
    true/false there as 1/0, so that `train.max_steps=true` trained one step."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) in (Annotated, Union, types.UnionType):
        args = [a for a in get_args(annotation)[:1 if get_origin(annotation) is Annotated else None]
                if a is not type(None)]
        return bool(args) and all(_numeric(a) for a in args)
    return False


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _true_or_false_is_no_number(cls, data: Any) -> Any:
        """true/false given for a number reaches pydantic as the word it was, which it refuses
        naming the key (a bool would pass as 1 or 0)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        words = {k: str(v).lower() for k, v in data.items() if isinstance(v, bool)
                 and k in fields and _numeric(fields[k].annotation)}
        return {**data, **words} if words else data


# A path from a YAML file, a quoted override or `run.dir=~/x` (a shell expands `~` only at the
# start of a word) reaches the config unexpanded; every process must read it as the shell would,
# never as a directory named `~`.
UserPath = Annotated[str, AfterValidator(os.path.expanduser)]

"""The base of every config section: unknown keys are refused, assignments validated; and the
type of every setting that names a file or directory (`UserPath`).

Its own module (torch- and dtlab-free) because the strategies' option sections, declared beside
each strategy in `dtlab/strategies/*_spec.py`, and the schema in `dtlab/config/schema.py` both
build on it, and the schema assembles `strategy.*` from those descriptions.
"""

import os
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# A path from a YAML file, a quoted override or `run.dir=~/x` (a shell expands `~` only at the
# start of a word) reaches the config unexpanded; every process must read it as the shell would,
# never as a directory named `~`.
UserPath = Annotated[str, AfterValidator(os.path.expanduser)]

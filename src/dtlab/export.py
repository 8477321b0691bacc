"""`dtlab export CKPT -o FILE`: a checkpoint's full (unsharded) model as one safetensors file,
in one process. The output path is checked before anything is loaded; the file is written whole
or not at all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtlab import files
from dtlab.checkpoint import dcp_load, verify
from dtlab.errors import DtlabError


def checkpoint_model(path: Path) -> tuple[Any, Any]:
    """(config, full model) of a verified checkpoint, loaded in one process."""
    from dtlab.config import Config
    from dtlab.data import spec_for
    from dtlab.models import build_model

    cfg = Config.model_validate(verify(path)["config"])
    model = build_model(cfg.model, spec_for(cfg))
    dcp_load({"model": model.state_dict()}, path)  # into the parameters the state dict shares
    return cfg, model


def export(path: Path, out: Path) -> Path:
    """The full (unsharded) model of a checkpoint as one safetensors file, in one process."""
    from safetensors.torch import save_file

    out = Path(out)  # the CLI has checked it is no directory
    problem = files.not_a_directory(out.parent, "the directory of -o", "choose another -o")
    if problem:
        raise DtlabError(problem)
    _, model = checkpoint_model(path)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}

    def write(tmp: Path) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(tmp))

    files.write_whole(out, write, f"writing '{out}'", "-o")
    return out

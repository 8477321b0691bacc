"""`dtlab export CKPT -o FILE`: a checkpoint's full (unsharded) model as one safetensors file,
in one process. The output path is checked before anything is loaded; the file is written whole
or not at all."""

from __future__ import annotations

from pathlib import Path

from dtlab import files
from dtlab.checkpoint import dcp_load, verify
from dtlab.errors import DtlabError


def export(path: Path, out: Path) -> Path:
    """The full (unsharded) model of a checkpoint as one safetensors file, in one process."""
    from safetensors.torch import save_file

    from dtlab.config import Config
    from dtlab.data import spec_for
    from dtlab.models import build_model

    out = Path(out)  # the CLI has checked it is no directory
    problem = files.not_a_directory(out.parent, "the directory of -o", "choose another -o")
    if problem:
        raise DtlabError(problem)
    manifest = verify(path)
    cfg = Config.model_validate(manifest["config"])
    model = build_model(cfg.model, spec_for(cfg))
    state = model.state_dict()
    dcp_load({"model": state}, path)
    state = {k: v.detach().clone().contiguous() for k, v in state.items()}

    def write(tmp: Path) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(tmp))

    files.write_whole(out, write, f"writing '{out}'", "-o")
    return out

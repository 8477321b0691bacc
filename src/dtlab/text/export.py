"""`dtlab export CKPT -o FILE`: a checkpoint's full (unsharded) model as one safetensors file,
in one process. `--format hf -o DIR`: a directory that Hugging Face transformers loads
(config.json and safetensors weights in the model's HF layout, sharded above --max-shard-size),
read from the checkpoint one block at a time. The output is checked before anything is loaded
and written whole or not at all (dtlab/atomic_write.py); it replaces only an earlier export of
the same kind (marked in its safetensors headers) unless --overwrite is given."""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from dtlab import atomic_write, files, owned
from dtlab.errors import DtlabError
from dtlab.levers import lora
from dtlab.models import gpt_hf, hf
from dtlab.run.checkpoint import _safe_reader, dcp_load, verify
from dtlab.run.neighbours import OUTPUT_NAMES

# (model config, tensors under dtlab's names) -> (config.json, (HF name, tensor) in model order)
Layout = Callable[[Any, Mapping[str, torch.Tensor]],
                  tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]]
# model.name -> its Hugging Face layout. A model kind gains `--format hf` with an entry here
# (models/gpt_hf.py is the example); the rest of the export does not depend on the model.
HF_LAYOUTS: dict[str, Layout] = {"gpt": gpt_hf.to_gpt2, "hf": hf.to_hf}
DEFAULT_SHARD = "5GB"
# Written into every exported safetensors header: an earlier export (this key, the same kind)
# may be replaced without --overwrite; any other file or directory may not.
MARK = "dtlab_export"
KINDS = {"safetensors": "file", "hf": "directory"}
DEFAULTS = {"safetensors": "model.safetensors", "hf": "hf-model"}
HF_FILES = re.compile(r"config\.json|model(-\d{5}-of-\d{5})?\.safetensors|"
                      r"model\.safetensors\.index\.json")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def verified(path: Path) -> dict[str, Any]:
    """verify(path), its refusal with what to do when it says none."""
    from dtlab.run.checkpoint import CheckpointError

    try:
        return verify(path)
    except CheckpointError as e:
        if "; fix:" in str(e):
            raise
        raise CheckpointError(f"{e}; fix: export another checkpoint of the run (its "
                              "checkpoints/step_NNNNNN), or restore a good copy of this one") \
            from None


def checkpoint_model(path: Path) -> tuple[Any, Any]:
    """(config, full model) of a verified checkpoint, loaded in one process."""
    from dtlab.config import Config
    from dtlab.data import spec_for
    from dtlab.models import build_model

    cfg = Config.model_validate(verified(path)["config"])
    model = build_model(cfg.model, spec_for(cfg), cfg.train.lora)
    dcp_load({"model": model.state_dict()}, path)  # into the parameters the state dict shares
    return cfg, model


def export(path: Path, out: Path, overwrite: bool = False) -> Path:
    """The full (unsharded) model of a checkpoint as one safetensors file, in one process."""
    from safetensors.torch import save_file

    out = Path(out)  # the CLI has checked it is no directory
    problem = files.not_a_directory(out.parent, "the directory of -o", "choose another -o")
    if problem:
        raise DtlabError(problem)
    check_replace(out, "safetensors", path, overwrite)
    cfg, model = checkpoint_model(path)
    merged = lora.plain(model.state_dict(), cfg.train.lora)  # adapters folded into the weights
    state = {k: merged[k].detach().clone().contiguous() for k in merged}

    def write(tmp: Path) -> None:
        save_file(state, str(tmp), metadata={"format": "pt", MARK: "safetensors"})
        os.chmod(tmp, 0o666 & ~_umask())

    atomic_write.write_atomic(out, write, f"writing '{out}'", "-o")
    return out


def export_mark(file: Path) -> str | None:
    """The kind of `dtlab export` that wrote a safetensors file (its header's metadata), None
    for any other file. Only the JSON header is read."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length)) if 2 <= length <= 100 << 20 else None
    except (OSError, ValueError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    mark = meta.get(MARK) if isinstance(meta, dict) else None
    return mark if isinstance(mark, str) else None


def said_of(out: Path, kind: str) -> str:
    """How the export's last line names what it does to `out` (the checks allowed it): an
    earlier export of `kind` replaced, or what --overwrite replaced, is said as such."""
    taken = os.path.lexists(out) and not (out.is_dir() and not any(out.iterdir()))
    if not taken:
        return "written"
    shaped = out.is_dir() if kind == "hf" else out.is_file()
    earlier = shaped and _not_an_export(out, kind) is None
    return "replaced the earlier export" if earlier else "replaced (--overwrite)"


def _not_an_export(out: Path, kind: str) -> str | None:
    """Why replacing `out` could lose something (it is not an earlier export of `kind`), or
    None when it is one, or when nothing is there."""
    if not out.exists() and not out.is_symlink():
        return None
    if kind == "safetensors":
        return None if export_mark(out) == kind else "is a file that dtlab export did not write"
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return None
    others = [n for n in names if not HF_FILES.fullmatch(n)]
    if others:
        return f"is a directory holding files dtlab export did not write ({', '.join(others[:3])})"
    if not any(export_mark(out / n) == kind for n in names if n.endswith(".safetensors")):
        return "is a directory that is not an earlier dtlab export --format hf"
    return None


def check_outside_checkpoint(out: Path, checkpoint: Path) -> Path:
    """`out` neither overlaps the checkpoint nor takes a name of its run's outputs (the CLI asks
    first, so that its fix for a directory -o is never a path inside the checkpoint). Returns
    the run's directory."""
    source, target = Path(checkpoint).resolve(), Path(out).resolve()
    run = source.parent.parent if source.parent.name == "checkpoints" else source
    # in its run under a name the run writes: RUN/model.safetensors would pass for the run's own
    under_run = target.relative_to(run).parts[0] if run in target.parents else None
    if target == source or source in target.parents or target in source.parents or (
            under_run and any(fnmatch.fnmatchcase(under_run, p) for p in OUTPUT_NAMES)):
        raise DtlabError(f"-o/--output '{out}' overlaps the checkpoint '{checkpoint}' it is "
                         "read from, or its run's own outputs; fix: choose a path outside the "
                         "checkpoint and its run")
    return run


def check_replace(out: Path, kind: str, checkpoint: Path, overwrite: bool) -> None:
    """Before anything is loaded: `out` is new, empty, or an earlier export of this kind (which
    is replaced); anything else only with --overwrite. Never the checkpoint or a path inside
    or around it, which the replacement would delete."""
    run = check_outside_checkpoint(out, checkpoint)
    target = out.resolve()
    owned.check_made_from(out, "-o/--output", [run])  # another run's, compare's, sweep's
    if any(target == p or target in p.parents for p in (Path.cwd().resolve(),
                                                       Path.home().resolve())):
        raise DtlabError(f"-o/--output '{out}' holds the current or the home directory, which an "
                         f"export replaces; fix: name a new {KINDS[kind]}, e.g. -o "
                         f"{out / DEFAULTS[kind]}")
    folder = out.parent
    if kind == "safetensors" and folder.is_dir() and \
            any(export_mark(f) == "hf" for f in folder.glob("*.safetensors")):
        raise DtlabError(f"-o/--output '{out}' is inside the Hugging Face export '{folder}', "
                         "whose config and weights would no longer match; fix: export --format "
                         f"hf -o {folder} to replace that export, or another -o")
    why = _not_an_export(out, kind)
    if why and why.startswith("is a directory holding"):  # the user's own files: --overwrite too
        raise DtlabError(f"-o/--output '{out}' {why}, which exporting there would delete; fix: "
                         "choose another -o, or move them out of it")
    if why and not overwrite:
        raise DtlabError(f"-o/--output '{out}' {why}, and exporting would replace it; fix: "
                         "choose another -o, or add --overwrite to replace it")


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """Bytes of '5GB', '500MB', '2GiB', '1.5GB' or '1000000' (units as Hugging Face reads them:
    KB/MB/GB decimal, KiB/MiB/GiB binary); DtlabError naming `flag` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    size = int(float(m.group(1)) * _UNITS[unit]) if m and unit in _UNITS else 0
    if size < 1:
        raise DtlabError(f"{flag} '{text}' is not a size in bytes above 0; fix: give a number "
                         f"and a unit, e.g. {flag} 2GB (KB, MB, GB, or KiB, MiB, GiB)")
    return size


def export_hf(path: Path, out: Path, max_shard_bytes: int, overwrite: bool = False) -> Path:
    """A checkpoint's model as a Hugging Face directory: config.json plus model.safetensors, or
    model-0000i-of-0000N.safetensors and model.safetensors.index.json above max_shard_bytes.
    Memory: about one block of the checkpoint plus one output shard."""
    from dtlab.config import Config

    out = Path(out)
    problem = files.not_a_directory(out, "-o/--output", "name a new directory")
    if problem:
        raise DtlabError(problem)
    check_replace(out, "hf", path, overwrite)
    files.check_writable_dir(out, "-o/--output", beside=True)
    cfg = Config.model_validate(verified(path)["config"])
    model_cfg = cfg.model
    layout = HF_LAYOUTS.get(model_cfg.name)
    if layout is None:
        names = ", ".join(f"model.name={n}" for n in HF_LAYOUTS)
        raise DtlabError(f"--format hf exports language models ({names}); checkpoint '{path}' "
                         f"holds model.name={model_cfg.name}; fix: use --format safetensors")
    config, tensors = layout(model_cfg, lora.plain(CheckpointTensors(path), cfg.train.lora))

    def write(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_shards(tensors, tmp, max_shard_bytes)

    atomic_write.write_atomic(out, write, f"writing '{out}'", "-o")
    return out


def _group(name: str) -> str:
    """The keys read together: those up to the first number ("h.3" of "h.3.attn.q_proj.weight":
    one block), else the key alone."""
    parts = name.split(".")
    i = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return name if i is None else ".".join(parts[:i + 1])


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """The model tensors of a DCP checkpoint under their model names, read on demand a group
    (a block) at a time; only the group read last is kept, so a caller that asks in model order
    holds one block. Shapes and dtypes come from DCP's metadata."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = Path(path)
        metadata = _safe_reader()(str(path)).read_metadata().state_dict_metadata
        self.meta = {k.removeprefix("model."): v for k, v in metadata.items()
                     if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
        self.loaded: tuple[str | None, dict[str, torch.Tensor]] = (None, {})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.meta:
            raise KeyError(name)
        group = _group(name)
        if self.loaded[0] != group:
            self.loaded = (None, {})  # let the previous group go before the next is read
            tensors = {k: torch.empty(m.size, dtype=m.properties.dtype)
                       for k, m in self.meta.items() if _group(k) == group}
            dcp_load({"model": tensors}, self.path)  # DCP reads just these keys
            self.loaded = (group, tensors)
        return self.loaded[1][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.meta)

    def __len__(self) -> int:
        return len(self.meta)


def write_shards(tensors: Iterable[tuple[str, torch.Tensor]], directory: Path,
                 max_shard_bytes: int) -> list[str]:
    """Hugging Face's sharded safetensors: files of at most max_shard_bytes (a larger tensor
    alone in one), filled in order; one file, model.safetensors, when everything fits. Returns
    the file names."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:  # named once the count is known
        save_file(shard, str(directory / f".shard-{len(shards)}"), metadata={"format": "pt",
                                                                           MARK: "hf"})
        shards.append(list(shard))

    for name, tensor in tensors:
        tensor = tensor.detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
        total += nbytes
    if shard or not shards:
        flush()
    n = len(shards)
    names = (["model.safetensors"] if n == 1 else
             [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    mode = 0o666 & ~_umask()  # safetensors creates its files 0600: a model is for sharing
    for i, name in enumerate(names):
        os.chmod(directory / f".shard-{i}", mode)
        os.replace(directory / f".shard-{i}", directory / name)
    if n > 1:
        weight_map = {key: name for name, keys in zip(names, shards, strict=True) for key in keys}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _umask() -> int:
    mask = os.umask(0o022)  # reading it means setting it: put it straight back
    os.umask(mask)
    return mask


"""A cluster file: what one node type offers a prediction, every number with where it comes from.

    load_cluster("h100_sxm_8x")            a file shipped with dtlab, by name
    load_cluster("my_cluster.yaml")        any file of the same form

The shipped files live in src/dtlab/predict/clusters/ (package data, so `dtlab predict --cluster
h100_sxm_8x` works from an installed wheel as from a checkout); configs/clusters/ in the
repository is a link to that directory, the place the docs name. A file holds: the device and
its memory, GPUs per node, peak TFLOP/s per dtype (or `measure`: a float32 matmul measured on
this CPU at prediction time), HBM bandwidth, the intra- and inter-node links, the roofline's
compute_efficiency, the overlap_slowdown (compute while communication runs) and the
comm_overlap_slowdown (communication while compute runs), each with its `*_source`. Bandwidths follow
nccl-tests' bus-bandwidth convention (price.py). A link is either a bus bandwidth and a latency,
or `comm_results:` a `dtlab comm --json` (or --csv) file, relative to the cluster file, whose
alpha-beta fit (dtlab/comm/model.py) prices it; a fit that model refuses is refused here, when
the file loads. An entry `{file: F, measured_below: BYTES}` prices the sizes below BYTES from
F's measured times on its ranks and fits the line to the larger ones (gloo's one-element
collectives cost a fraction of its line's latency).

Every mistake in a file (YAML, a key written twice, an unknown or missing key, a number out of
range, an unusable fit) is one ConfigError line naming the file, the key and the fix.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dtlab.comm.model import PoorFitError, fit_file
from dtlab.config.load import read_yaml
from dtlab.errors import ConfigError
from dtlab.files import meminfo
from dtlab.instruments.machine_load import cpu_set
from dtlab.predict.cluster_file import EXAMPLE, ClusterSpec, LinkSpec, problem

CLUSTER_DIR = Path(__file__).resolve().parent / "clusters"



@dataclass(frozen=True)
class Link:
    """One tier of links (within a node, or across nodes), per GPU: nccl-tests' bus bandwidth
    in bytes/s and the time of a small collective, or `by_world`: dtlab comm alpha-beta fits."""

    bus_bytes_per_s: float | None
    latency_s: float | None
    source: str
    by_world: dict[int, dict[str, dict[str, Any]]] | None = None  # every fit, by its ranks
    sync_s: dict[int, float] | None = None  # a collective's cost inside a step beyond its fit
    sync_source: str = ""
    burst: dict[str, dict[int, float]] | None = None  # op -> ranks -> factor (burst_for)
    burst_source: str = ""

    @property
    def fit(self) -> dict[str, dict[str, Any]] | None:
        """The fit of the fewest ranks measured (None: a bandwidth and a latency instead)."""
        return self.by_world[min(self.by_world)] if self.by_world else None

    def fit_for(self, n: int) -> dict[str, dict[str, Any]] | None:
        """The fit measured on the most ranks up to n (the fewest measured, below them): on
        a shared host the ranks' count changes the cost of a collective beyond the ring's
        terms (their threads share the cores)."""
        return self.by_world[_nearest_below(self.by_world, n)] if self.by_world else None

    def sync_for(self, n: int) -> float:
        """What a collective of n ranks costs inside a step beyond its price alone (0: not
        measured), from the measurement on the most ranks up to n."""
        return self.sync_s[_nearest_below(self.sync_s, n)] if self.sync_s else 0.0

    def burst_for(self, op: str, n: int) -> float:
        """What a call of `op` on n ranks issued back to back with others costs over its price
        (1: not measured), from the measurement on the most ranks up to n."""
        by_ranks = (self.burst or {}).get(op)
        return by_ranks[_nearest_below(by_ranks, n)] if by_ranks else 1.0


def _nearest_below(by_ranks: dict[int, Any], n: int) -> int:
    below = [w for w in sorted(by_ranks) if w <= n]
    return below[-1] if below else min(by_ranks)


@dataclass
class Cluster:
    name: str
    gpus_per_node: int
    device: str
    memory_bytes: int
    peak_tflops: dict[str, float | str]  # per dtype: TFLOP/s, or "measure" (this CPU, roofline.py)
    peak_source: str
    hbm_bytes_per_s: float | None  # None: unknown, the roofline counts FLOPs only
    intra: Link
    inter: Link
    compute_efficiency: float  # the roofline's fraction of peak: an assumption, stated
    overlap_slowdown: float  # compute runs (1 + this) x slower while communication runs
    overlap_slowdown_source: str
    comm_overlap_slowdown: float  # communication runs (1 + this) x slower while compute runs
    comm_overlap_slowdown_source: str
    cores: int | None  # CPU: cores the ranks of a node share (None: a device per rank)
    collectives_at_once: int = 1  # a rank's collectives in flight together (gloo: its threads)
    collectives_at_once_source: str = "one at a time: NCCL runs a communicator's on one stream"
    # CPU: how in step the ranks sharing cores compute, or per ms of compute between their
    # meetings (cores.py)
    phase_correlation: float | dict[float, float] = 1.0
    phase_correlation_source: str = "lockstep: every rank computes when the traced ones do"
    # per number of ranks: a real step's time beyond the simulated step's, as a fraction of it
    step_overhead: dict[int, float] | None = None
    step_overhead_source: str = ""
    notes: str = ""
    memory_source: str = ""
    hbm_source: str = ""
    compute_efficiency_source: str = ""
    path: Path | None = None

    def overhead_for(self, world: int) -> float:
        """What a real step of `world` ranks takes beyond the simulated one, as a fraction of
        it (0: one rank, or not measured), from the measurement on the most ranks up to world."""
        if world < 2 or not self.step_overhead:
            return 0.0
        return self.step_overhead[_nearest_below(self.step_overhead, world)]


# --------------------------------------------------------------------------------- loading
def shipped(cluster: Cluster) -> bool:
    """A file shipped with dtlab (edit a copy of it, not the file)."""
    return cluster.path is not None and cluster.path.resolve().parent == CLUSTER_DIR


def first_clause(source: str) -> str:
    """What a table line shows of a number's source: up to its first ': ' (the rest is the
    cluster file's; a time of day such as 20:37 stays whole)."""
    return source.split(": ")[0].strip()


def known_clusters() -> list[str]:
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def cluster_path(name_or_path: str) -> Path:
    """A file path as given, or the shipped file of that name; an unknown name: ConfigError."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        return Path(name_or_path)
    path = CLUSTER_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        close = [k for k in known_clusters() if k.startswith(name_or_path)][:1] or \
            difflib.get_close_matches(name_or_path, known_clusters(), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown cluster '{name_or_path}'{hint}; fix: use one of "
                          f"{', '.join(known_clusters())}, or pass a cluster file (.yaml, "
                          f"like {EXAMPLE})")
    return path


def load_cluster(name_or_path: str) -> Cluster:
    """The cluster a name or file describes. ConfigError (one line) for any problem with it."""
    path = cluster_path(name_or_path)
    try:
        tree = read_yaml(path, "cluster file", f"pass a cluster name "
                         f"({', '.join(known_clusters())}) or an existing file like {EXAMPLE}",
                         f"write a cluster's keys into it (see {EXAMPLE})")
    except ConfigError as e:  # read_yaml's example of a mapping is a training config's
        if "must hold a mapping" not in str(e):
            raise
        raise ConfigError(f"cluster file '{path}' must hold a mapping of keys (key: value "
                          f"lines); fix: write it like {EXAMPLE}") from None
    try:
        spec = ClusterSpec.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"cluster file '{path}': {problem(e)}") from None
    return Cluster(
        name=path.stem, gpus_per_node=spec.gpus_per_node, device=spec.device,
        memory_bytes=_memory_bytes(spec.memory_gb, path), memory_source=spec.memory_source,
        peak_tflops=dict(spec.peak_tflops), peak_source=spec.peak_source,
        hbm_bytes_per_s=None if spec.hbm_gb_per_s is None else spec.hbm_gb_per_s * 1e9,
        hbm_source=spec.hbm_source,
        intra=_link(spec.intra, path, "intra"), inter=_link(spec.inter, path, "inter"),
        compute_efficiency=spec.compute_efficiency,
        compute_efficiency_source=spec.compute_efficiency_source,
        overlap_slowdown=spec.overlap_slowdown,
        overlap_slowdown_source=spec.overlap_slowdown_source,
        comm_overlap_slowdown=spec.comm_overlap_slowdown,
        comm_overlap_slowdown_source=spec.comm_overlap_slowdown_source,
        collectives_at_once=spec.collectives_at_once,
        **({"collectives_at_once_source": spec.collectives_at_once_source}
           if spec.collectives_at_once_source else {}),
        cores=len(cpu_set()) if spec.cores == "machine" else spec.cores,
        **({"phase_correlation": spec.phase_correlation,
            "phase_correlation_source": spec.phase_correlation_source}
           if spec.phase_correlation is not None else {}),
        **({"step_overhead": _per_ranks(spec.step_overhead),
            "step_overhead_source": spec.step_overhead_source or ""}
           if spec.step_overhead is not None else {}),
        notes=spec.notes, path=path)


def _per_ranks(value: float | dict[int, float]) -> dict[int, float]:
    """A number measured per number of ranks: one value (measured on 2 ranks) or the mapping."""
    return dict(value) if isinstance(value, dict) else {2: value}


def _memory_bytes(memory_gb: float | str, path: Path) -> int:
    if memory_gb != "machine":
        return int(float(memory_gb) * 1e9)
    total = meminfo().get("MemTotal")
    if not total:
        raise ConfigError(f"cluster file '{path}': memory_gb: machine, and /proc/meminfo cannot "
                          "be read here; fix: set memory_gb to the machine's memory in GB")
    return total


def _link(spec: LinkSpec, path: Path, key: str) -> Link:
    if spec.comm_results is None:
        assert spec.busbw_gb_per_s is not None and spec.latency_us is not None
        return Link(spec.busbw_gb_per_s * 1e9, spec.latency_us * 1e-6, spec.source,
                    **_beyond_price(spec))
    entries = [spec.comm_results] if isinstance(spec.comm_results, str) else spec.comm_results
    if not entries:
        raise ConfigError(f"cluster file '{path}': {key}.comm_results is an empty list; fix: "
                          "name a dtlab comm --json file (or one per number of ranks)")
    by_world: dict[int, dict[str, dict[str, Any]]] = {}
    names = []
    for entry in entries:
        name, fits, below = (entry, spec.fits, 0) if isinstance(entry, str) else \
            (entry.file, entry.fits, entry.measured_below)
        names.append(name)
        results = path.parent / name if not Path(name).is_absolute() else Path(name)
        used = _used_fits(fits, _fit_of(results, path, key, below), results, path, key)
        worlds = sorted({m["world_size"] for m in used.values()})
        if len(worlds) != 1 or worlds[0] in by_world:
            what = "several numbers of ranks" if len(worlds) != 1 else \
                f"{worlds[0]} ranks, as another of its files does"
            raise ConfigError(f"cluster file '{path}': {key}.comm_results: {results} measures "
                              f"{what}; fix: one dtlab comm --json file per number of ranks")
        by_world[worlds[0]] = used
    ops = sorted({op for used in by_world.values() for op in used})
    worlds_text = ", ".join(str(w) for w in sorted(by_world))
    return Link(None, None, f"{spec.source} (alpha-beta fit of {', '.join(names)} on "
                f"{worlds_text} ranks: {', '.join(ops)})", by_world=by_world, **_beyond_price(spec))


def _beyond_price(spec: LinkSpec) -> dict[str, Any]:
    """The link's costs beyond its price: sync (inside a step), burst (back to back)."""
    out: dict[str, Any] = {}
    if spec.sync_us is not None:
        out.update(sync_s={n: us * 1e-6 for n, us in _per_ranks(spec.sync_us).items()},
                   sync_source=spec.sync_source or "")
    if spec.burst is not None:
        out.update(burst={op: dict(f) for op, f in spec.burst.items()},
                   burst_source=spec.burst_source or "")
    return out


def _used_fits(fits: list[str] | None, fitted: dict[str, dict[str, Any]], results: Path,
               path: Path, key: str) -> dict[str, dict[str, Any]]:
    used = {op: m for op, m in fitted.items() if fits is None or op in fits}
    for op in fits or []:
        if op not in fitted:
            raise ConfigError(f"cluster file '{path}': {key}.fits names {op}, which {results} "
                              f"does not measure ({', '.join(fitted)}); fix: remove it from "
                              f"{key}.fits, or measure it with dtlab comm --op all")
    if "all_reduce" not in used:  # what every op without its own fit is priced from
        raise ConfigError(f"cluster file '{path}': {key}: no all_reduce fit in {results} (every "
                          f"op without its own fit is priced from it); fix: measure it with "
                          "dtlab comm --op all --json FILE, and keep all_reduce in fits")
    for op, m in used.items():
        if m["refused"]:
            raise PoorFitError(f"cluster file '{path}': {key}: the {op} fit of {results} "
                               f"({m['world_size']} ranks) is refused: {m['refused']}; or "
                               f"leave {op} out of {key}.fits (it is then priced from the "
                               "all_reduce fit)")
    return used


def _fit_of(results: Path, path: Path, key: str, line_from: int) -> dict[str, dict[str, Any]]:
    measure = f"measure it with dtlab comm --op all --json {results}"
    if not results.is_file():
        raise ConfigError(f"cluster file '{path}': {key}.comm_results '{results}' not found; "
                          f"fix: {measure}, or correct the path (relative to the cluster file)")
    try:
        fitted = fit_file(results, line_from)
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError):
        raise ConfigError(f"cluster file '{path}': {key}.comm_results '{results}' is not a "
                          f"dtlab comm --json/--csv file; fix: {measure}") from None
    if not fitted:
        raise ConfigError(f"cluster file '{path}': {key}.comm_results '{results}' has no "
                          f"collective measured; fix: {measure}")
    return fitted

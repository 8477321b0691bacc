"""A cluster file's form (cluster.py loads it): the keys, their types and ranges, and the one line
each mistake reads as (`problem`: `key: what; fix: how`)."""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DTYPES = ("bf16", "fp16", "fp32")
FIT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
           "send_recv")
BURST_OPS = FIT_OPS[:-1]
EXAMPLE = "configs/clusters/h100_sxm_8x.yaml"

_Positive = Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)]
_NonNegative = Annotated[float, Field(ge=0, strict=True, allow_inf_nan=False)]
_Source = Annotated[str, Field(min_length=1, strict=True)]
_Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
_Fraction = Annotated[float, Field(ge=0, le=1, strict=True, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _ResultsSpec(_Strict):
    """One dtlab comm file of a link, with the fits it trusts (else the link's `fits`)."""

    file: _Source
    fits: list[Literal[FIT_OPS]] | None = None  # type: ignore[valid-type]
    # sizes below this many bytes are priced as measured, not from the line (comm/model.py)
    measured_below: Annotated[int, Field(ge=0, strict=True)] = 0


class LinkSpec(_Strict):
    busbw_gb_per_s: _Positive | None = None
    latency_us: _NonNegative | None = None
    comm_results: str | list[str | _ResultsSpec] | None = None  # a file per number of ranks
    fits: list[Literal[FIT_OPS]] | None = None  # type: ignore[valid-type]
    sync_us: _NonNegative | dict[Annotated[int, Field(ge=2)], _NonNegative] | None = None
    sync_source: _Source | None = None
    # per op, per number of ranks: a call issued back to back with others costs its price x this
    burst: dict[Literal[BURST_OPS], dict[Annotated[int, Field(ge=2)], _Positive]] | None = None  # type: ignore[valid-type]
    burst_source: _Source | None = None
    source: _Source

    @model_validator(mode="after")
    def _sourced(self) -> LinkSpec:
        _paired(self, "sync_us", "sync_source",
                "the cost of a collective inside a step, benchmarks/sync_cost.py")
        _paired(self, "burst", "burst_source", "what a call issued back to back with others "
                "costs over its price, benchmarks/burst_cost.py")
        return self

    @model_validator(mode="after")
    def _one_form(self) -> LinkSpec:
        bandwidth = self.busbw_gb_per_s is not None or self.latency_us is not None
        if self.comm_results is not None and bandwidth:
            raise ValueError("gives both comm_results and busbw_gb_per_s/latency_us; fix: keep "
                             "one: a dtlab comm --json file, or a bandwidth and a latency")
        if self.comm_results is None and (self.busbw_gb_per_s is None or self.latency_us is None):
            missing = "busbw_gb_per_s" if self.busbw_gb_per_s is None else "latency_us"
            raise ValueError(f"has no {missing}; fix: give busbw_gb_per_s and latency_us, or "
                             "comm_results: a dtlab comm --json file")
        if self.fits is not None and self.comm_results is None:
            raise ValueError("lists fits without comm_results; fix: remove fits, or add "
                             "comm_results: a dtlab comm --json file")
        return self


class ClusterSpec(_Strict):
    device: _Source
    gpus_per_node: Annotated[int, Field(gt=0, strict=True)]
    memory_gb: _Positive | Literal["machine"]
    memory_source: _Source
    peak_tflops: Annotated[dict[Literal[DTYPES], _Positive | Literal["measure"]],  # type: ignore[valid-type]
                           Field(min_length=1)]
    peak_source: _Source
    hbm_gb_per_s: _Positive | None
    hbm_source: _Source
    compute_efficiency: Annotated[float, Field(gt=0, le=1, strict=True)]
    compute_efficiency_source: _Source
    overlap_slowdown: Annotated[float, Field(ge=0, le=10, strict=True, allow_inf_nan=False)]
    overlap_slowdown_source: _Source
    comm_overlap_slowdown: Annotated[float, Field(ge=0, le=100, strict=True,
                                                  allow_inf_nan=False)]
    comm_overlap_slowdown_source: _Source
    collectives_at_once: Annotated[int, Field(ge=1, le=64, strict=True)] = 1
    collectives_at_once_source: _Source | None = None
    cores: Annotated[int, Field(gt=0, strict=True)] | Literal["machine"] | None
    # one value, or {ms of compute between two meetings of the ranks: value} as measured
    phase_correlation: _Number | dict[float, _Number] | None = None
    phase_correlation_source: _Source | None = None
    # per number of ranks: what a real step takes beyond the simulated one, as a fraction of it
    step_overhead: _Fraction | dict[Annotated[int, Field(ge=2)], _Fraction] | None = None
    step_overhead_source: _Source | None = None
    intra: LinkSpec
    inter: LinkSpec
    notes: str = ""

    @model_validator(mode="after")
    def _phase_sourced(self) -> ClusterSpec:
        _paired(self, "phase_correlation", "phase_correlation_source", "how in step the ranks "
                "sharing a CPU's cores compute, 0 to 1, benchmarks/sync_cost.py", "the file ")
        rho = self.phase_correlation
        table = rho if isinstance(rho, dict) else {1.0: rho}
        if rho is not None and (not table or any(not ms > 0 or not 0 <= r <= 1
                                                 for ms, r in table.items())):
            raise ValueError(f"phase_correlation {rho} is not a number from 0 to 1 or a mapping "
                             "of milliseconds of compute (> 0) to such numbers; fix: give what "
                             "benchmarks/sync_cost.py --world 4 measured (0 to 1), one value or "
                             "one per --matmuls")
        if self.phase_correlation is not None and self.cores is None:
            raise ValueError("the file gives phase_correlation without cores; fix: remove it "
                             "(it is how ranks share a CPU host's cores) or set cores")
        return self

    @model_validator(mode="after")
    def _overhead_sourced(self) -> ClusterSpec:
        _paired(self, "step_overhead", "step_overhead_source", "what a real step of that many "
                "ranks takes beyond the simulated one, benchmarks/calibrate_cpu.py", "the file ")
        return self


def _paired(spec: BaseModel, value: str, source: str, what: str, who: str = "") -> None:
    """A number and its source come together or not at all."""
    if (getattr(spec, value) is None) != (getattr(spec, source) is None):
        raise ValueError(f"{who}gives one of {value} and {source}; fix: give both ({what}, and "
                         "where it comes from) or neither")


def problem(e: ValidationError) -> str:
    """The first problem of the file as `key: what; fix: how` (an unknown key first: a misspelt
    key is also a missing one)."""
    errors = sorted(e.errors(), key=lambda x: x["type"] != "extra_forbidden")
    err = errors[0]
    loc = [str(p) for p in err["loc"] if not _is_union_member(str(p))]
    key = _key_of(err["loc"])
    more = len({_key_of(x["loc"]) for x in errors} - {key})
    tail = f" (and {more} more problem(s))" if more else ""
    if err["type"] == "extra_forbidden":
        parent = _spec_at(loc[:-1])
        close = difflib.get_close_matches(loc[-1], list(parent.model_fields), n=1, cutoff=0.5) \
            if parent else []
        hint = f"did you mean '{'.'.join([*loc[:-1], close[0]])}'?" if close else \
            f"see {EXAMPLE} for every key"
        return f"unknown key '{key}'; fix: remove it ({hint}){tail}"
    if err["type"] == "missing":
        return f"'{key}' is missing; fix: add it (every key of {EXAMPLE} is needed){tail}"
    if err["type"] == "value_error":
        return f"{key} {err['msg'].removeprefix('Value error, ')}{tail}".lstrip()
    if "[key]" in loc:  # (..., 'peak_tflops', 'fp8', '[key]')
        return (f"{'.'.join(loc[:-2])}: '{err.get('input')}' is not a dtype; fix: use "
                f"{', '.join(DTYPES)}{tail}")
    if err["type"] in ("model_type", "dict_type"):
        what = "a mapping of a link's keys (see intra: in " if key in ("intra", "inter") else \
            "a mapping (see "
        return f"{key} must be {what}{EXAMPLE}){tail}"
    got = err.get("input")
    shown = f" (got {got!r})" if got is not None and not isinstance(got, (dict, list)) else ""
    msgs = list(dict.fromkeys(x["msg"] for x in errors if _key_of(x["loc"]) == key))
    msg = " or ".join([msgs[0], *(m.removeprefix("Input should be ") for m in msgs[1:])])
    return f"{key}: {msg}{shown}; fix: set {key} to a valid value (see {EXAMPLE}){tail}"


def _key_of(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not _is_union_member(str(p)) and p != "[key]")


def _is_union_member(part: str) -> bool:
    """pydantic names the member of a union it tried: 'float', "literal['machine']", 'int'."""
    return part in ("float", "int", "str", "none") or part.startswith(("literal[", "constrained-",
                                                                         "dict["))


def _spec_at(loc: list[str]) -> type[BaseModel] | None:
    spec: type[BaseModel] = ClusterSpec
    for part in loc:
        if part in ("intra", "inter") and spec is ClusterSpec:
            spec = LinkSpec
        else:
            return None
    return spec

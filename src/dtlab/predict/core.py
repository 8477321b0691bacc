"""One prediction: a config's strategy on N ranks of a cluster -> step time, throughput, MFU and
memory, each number with where it came from.

    trace    dtlab's own strategy wrappers, one step under a recording fake process group at
             the target world size (trace.py): what each rank computes, issues and waits for
    price    compute: measured on this device (--measure), a profile file (--profile), or a
             roofline over the cluster's peak; communication: the cluster's links or a dtlab
             comm fit (price.py, roofline.py)
    simulate the traced ranks' events on compute and communication streams (simulate.py)
    memory   `dtlab estimate`'s bytes per rank (measured under the fake backend, or modelled)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from dtlab.config import Config
from dtlab.config.strategies import registry
from dtlab.errors import ConfigError
from dtlab.predict.cluster import first_clause
from dtlab.predict.events import CPU_CLOCK, Compute, Issue, Trace
from dtlab.predict.host import core_share, load_probe, machine_loaded, simulate_shared
from dtlab.predict.memory import memory
from dtlab.predict.profile import Profile

MEASURE_MAX_PARAMS = 50_000_000  # what --measure runs on a CPU in seconds (estimate's limit)


@dataclass
class Request:
    path: str | None  # the config file (None: the built-in quick config)
    overrides: list[str]
    world: int
    ranks_per_node: int
    cluster: Any  # predict.cluster.Cluster
    measure: bool = False  # compute measured on this device at each strategy's per-rank shapes
    profile: Profile | None = None  # compute from a profile file
    threads: int | None = None  # torch threads per rank when measuring on a CPU
    data_s: float = 0.0  # the part of a reported step a trace does not run: the batch's loading
    beside: bool = True  # on a CPU host, time compute with the node's other ranks running (corun.py)


def strategy_config(req: Request, token: str) -> Config:
    """The config of `token` (a dtlab strategy spec: fsdp, fsdp1:SHARD_GRAD_OP, fsdp_tp@8x8) on
    the request's model and world; its own checks refuse a world it cannot take, one line."""
    from dtlab.config import check_world, load_config

    cfg = load_config(req.path, [*req.overrides, *registry.parse(token)])
    wrong = registry.mesh_mismatch(token, req.world, "--world-size")
    if wrong:
        raise ConfigError(wrong)
    try:
        check_world(cfg, req.world, req.ranks_per_node)
    except ConfigError as e:
        raise ConfigError(f"--strategies '{token}' on --world-size {req.world}: {e}") from None
    return cfg


def model_digest(cfg: Config) -> str:
    """What a profile must match: the model's own section (not the strategy, batch or run)."""
    return hashlib.sha256(json.dumps(cfg.model.model_dump(mode="json"), sort_keys=True)
                          .encode()).hexdigest()[:16]


def trace_device(req: Request, cfg: Config) -> tuple[str, str | None]:
    """(device to trace on, why not measured): a real device for --measure when the model runs
    here in seconds, else the meta device (shapes and FLOPs only)."""
    import torch

    if not req.measure:
        return "meta", None
    n = model_params(cfg)
    if n > MEASURE_MAX_PARAMS:
        return "meta", (f"{n:,} parameters, more than the {MEASURE_MAX_PARAMS:,} measured here in "
                        "seconds: compute from the roofline, not measured")
    return ("cuda" if torch.cuda.is_available() else "cpu"), None


def traces_of(req: Request, cfg: Config, device: str) -> tuple[dict[int, Trace], float]:
    """The traced ranks' traces, and the CPU seconds of the processes that ran beside them
    (corun.py: on a CPU host, the node's other ranks)."""
    from dtlab.predict.corun import beside, cpu_clock, helpers_beside
    from dtlab.predict.streams import with_streams
    from dtlab.predict.trace import trace_step, traced_ranks

    threads = req.threads or 1
    ranks = traced_ranks(cfg, req.world, req.ranks_per_node)
    shared = device == "cpu" and req.beside
    count = helpers_beside(req.ranks_per_node, req.cluster.cores, threads) if shared else 0
    clock = shared and cpu_clock(req.ranks_per_node, req.cluster.cores, threads)
    with beside(cfg, req.world, ranks[0], req.ranks_per_node, threads, count) as helpers:
        traces = {r: trace_step(cfg, req.world, r, req.ranks_per_node, device=device,
                                threads=threads, cpu_clock=clock) for r in ranks}
    for t in traces.values():
        t.meta["beside"] = count
    if req.cluster.cores is None:  # a device per rank, with streams: the GPU's order of events
        traces = {r: with_streams(t) for r, t in traces.items()}
    return traces, helpers.cpu_s


def pricing(req: Request, cfg: Config, token: str) -> tuple[Any, Any, dict[str, set[str]]]:
    """compute_s(Compute) and comm_s(Issue) for the simulator, and the sources they used."""
    from dtlab.predict.price import comm_seconds
    from dtlab.predict.roofline import compute_seconds

    sources: dict[str, set[str]] = {"compute": set(), "comm": set()}
    dtype, threads = cfg.train.precision, req.threads or 1

    def compute_s(c: Compute) -> float:
        if c.seconds is None and req.profile is not None:
            try:
                seconds, source = req.profile.seconds(c, token)
                sources["compute"].add(source)
                return seconds
            except KeyError:
                pass
        seconds, source = compute_seconds(c, req.cluster, dtype, threads)
        sources["compute"].add(source)
        return seconds

    def comm_s(i: Issue) -> tuple[float, str]:
        seconds, tier = comm_seconds(i, req.cluster, req.ranks_per_node)
        sources["comm"].add(tier)
        return seconds, tier

    return compute_s, comm_s, sources


def model_params(cfg: Config) -> int:
    from dtlab.estimate.measure import meta_model
    from dtlab.models import count_params

    return count_params(meta_model(cfg))


def model_flops(cfg: Config) -> float:
    """Model FLOPs of one step of the global batch, as train's MFU counts them
    (instruments/flops.py): one sample's, times the batch (FLOPs grow linearly with it), counted
    once per model and kept (a Llama-3-8B takes seconds to count, the same for every strategy)."""
    key = json.dumps([cfg.model.model_dump(mode="json"), cfg.data.model_dump(mode="json"),
                      cfg.train.lora.model_dump(mode="json") if cfg.train.lora else None],
                     sort_keys=True)
    if key not in _FLOPS:
        from dtlab.data import spec_for
        from dtlab.instruments.flops import count

        plain = cfg.model_copy(update={"train": cfg.train.model_copy(
            update={"activation_checkpointing": "none"})})
        _FLOPS[key] = count(plain, spec_for(plain), 1)[0]
    return _FLOPS[key] * cfg.train.global_batch_size


_FLOPS: dict[str, float] = {}


def predict(req: Request, token: str, record: Profile | None = None) -> dict[str, Any]:
    """One row: `token`'s predicted step on the request's world and cluster. `record`: a
    profile to add the measured compute to (--save-profile)."""
    from dtlab.data import spec_for
    from dtlab.predict.roofline import peak_tflops
    from dtlab.predict.simulate import simulate

    cfg = strategy_config(req, token)
    notes: list[str] = []
    device, why = trace_device(req, cfg)
    if why:
        notes.append(why)
    if req.profile is not None:
        req.profile.check({"model_digest": model_digest(cfg), "dtype": cfg.train.precision,
                           "model": cfg.model.name, "n_params": model_params(cfg)})
    probe = load_probe(device)
    traces, helpers_cpu_s = traces_of(req, cfg, device)
    if count := traces[min(traces)].meta["beside"]:
        clock = traces[min(traces)].meta.get("clock") == CPU_CLOCK
        notes.append(f"compute timed with {count} other process(es) stepping the same model "
                     "beside it, as the node's other ranks share its memory in a run"
                     + (", on the traced thread's CPU clock (the cores' sharing is the "
                        "simulator's)" if clock else ""))
    loaded = machine_loaded(probe, req.threads or 1, helpers_cpu_s) if probe is not None else None
    if loaded:
        notes.append(f"compute measured while {loaded}: slower than this machine's; fix: "
                     "measure on an idle machine")
    if record is not None and device != "meta":
        record.meta.update(profile_meta(cfg, traces[min(traces)]))
        record.add(token, traces[min(traces)])
    compute_s, comm_s, sources = pricing(req, cfg, token)
    cores = core_share(req.cluster, req.threads or 1, req.ranks_per_node, req.world, traces,
                       notes, compute_s)
    timeline = simulate_shared(lambda share: simulate(
        traces, compute_s, comm_s, req.cluster.overlap_slowdown, cores=share,
        comm_slowdown=req.cluster.comm_overlap_slowdown,
        lanes=req.cluster.collectives_at_once), cores)
    # A real step of several ranks beyond its simulation (the cluster's measurement, if any)
    overhead_s = timeline.step_s * req.cluster.overhead_for(req.world)
    if overhead_s:
        sources["overhead"] = {first_clause(req.cluster.step_overhead_source)}
    step_s = timeline.step_s + overhead_s + req.data_s
    spec = spec_for(cfg)
    samples = cfg.train.global_batch_size / step_s
    flops = model_flops(cfg)
    peak, peak_source = peak_tflops(req.cluster, cfg.train.precision, req.threads or 1)
    mfu = flops / step_s / req.world / (peak * 1e12)
    row: dict[str, Any] = {
        "strategy": token, "world_size": req.world, "ranks_per_node": req.ranks_per_node,
        "step_s": step_s, "samples_per_s": samples, "samples_per_s_per_device": samples / req.world,
        "tokens_per_s": samples * spec.seq_len if spec.kind == "tokens" else None,
        "mfu": mfu, "peak_tflops": peak, "peak_source": peak_source,
        "model_flops_per_step": flops,
        "split": dict(timeline.split), "exposed_comm": dict(timeline.exposed),
        "comm_busy": dict(timeline.busy), "overhead_s": overhead_s, "data_s": req.data_s,
        "traced_on": device,
        "sources": {k: sorted(v) for k, v in sources.items()}, "notes": notes,
        "unreliable": loaded is not None}
    if tokens := row["tokens_per_s"]:
        row["tokens_per_s_per_device"] = tokens / req.world
    row["memory"] = memory(req, token, traces, notes)
    row["fits"] = row["memory"]["device_bytes"] <= req.cluster.memory_bytes
    return row


def profile_meta(cfg: Config, trace: Trace) -> dict[str, Any]:
    return {**{k: trace.meta.get(k) for k in ("device", "threads", "torch", "beside", "clock")},
            "dtype": cfg.train.precision, "model": cfg.model.name,
            "n_params": model_params(cfg), "model_digest": model_digest(cfg)}


def predict_step(path: str | None, overrides: list[str], token: str, world: int,
                 cluster: Any, threads: int | None = None) -> dict[str, Any]:
    """The prediction `--validate` and benchmarks/predict_vs_measured.py check against a run
    here: compute measured on this device at the strategy's per-rank shapes."""
    if threads is None and cluster.cores:  # what dtlab train gives each rank (distributed.py)
        threads = max(1, cluster.cores // world)
    return predict(Request(path, list(overrides), world, world, cluster, measure=True,
                           threads=threads, data_s=data_seconds(path, overrides)), token)


def data_seconds(path: str | None, overrides: list[str]) -> float:
    """What a step as `dtlab train` reports it (summary.json's median_step_time_s: the batch's
    loading, then the stepper) spends outside what a trace runs (the stepper: zero_grad, the
    micro steps, the gradient norm, the optimizer): loading the batch, the median of a short
    1-rank run on this CPU (the whole global batch: at most what one of N ranks loads), once per
    config and process. The rest of dtlab's loop (logging, the stop vote; `loop_overhead_s`)
    falls between two reported steps, and the stepper's own work is in the trace already."""
    from dtlab.predict.truth import measure_run

    key = json.dumps([path, sorted(overrides)])
    if key not in _DATA:
        plain = [o for o in overrides if not o.startswith("strategy.")]
        run = measure_run(path, [*plain, "strategy.name=single"], 1, 30)
        _DATA[key] = run["data_s"] or 0.0
    return _DATA[key]


_DATA: dict[str, float] = {}


# A predicted margin under this orders two strategies as their runs do barely more often than a
# coin: 29 of 51 pairs in the CPU check of 2026-11-28 (109 of 109 from 1.5x up; the same in the
# two checks before it: benchmarks/predict_ranking.py, docs/benchmarks.md).
CLOSE_CALL = 1.2
CLOSE_CALL_WHY = ("too close to call: predicted margins under 1.2x put two strategies in the "
                  "order their runs took 29 of 51 times in dtlab's check (docs/benchmarks.md); "
                  "fix: run both (dtlab compare)")


def fastest(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest strategy among those that fit, by how much it beats the next, and whether
    that is a margin a prediction can tell (`close_call`)."""
    fit = sorted((r for r in rows if r.get("fits", True)), key=lambda r: r["step_s"])
    if not fit:
        return None
    best = {"strategy": fit[0]["strategy"], "step_s": fit[0]["step_s"]}
    if len(fit) > 1:
        speedup = fit[1]["step_s"] / fit[0]["step_s"]
        best.update(runner_up=fit[1]["strategy"], speedup=speedup, close_call=speedup < CLOSE_CALL)
    return best


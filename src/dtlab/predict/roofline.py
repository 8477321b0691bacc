"""The seconds one stretch of compute takes on a cluster's device, and where that number comes from.

Measured (a trace taken on the target device): its seconds, as the traced rank ran them with its
own thread count (`threads`, which the profile records). Where the ranks of a node share a CPU,
the trace was timed with the node's other ranks running beside it on cores of their own
(corun.py: the memory they share is shared as in a run), and the simulator shares the cores
when the ranks outnumber them (cores.py).

Otherwise a roofline: max(FLOPs / (peak x compute_efficiency), bytes / HBM bandwidth), the
peak of the dtype from the cluster file (a datasheet) or, for `measure`, a float32 matrix
multiplication timed on this CPU now with the rank's threads. compute_efficiency is the file's
stated assumption of the fraction of peak the model's kernels reach; the bytes term is left out
where the trace counted no bytes or the file gives no bandwidth, and the source says so.

The caller passes measured seconds only from a trace taken on the cluster's own kind of device
(a CPU trace priced for an H100 node must come with seconds=None: the roofline then applies).
"""

from __future__ import annotations

from functools import lru_cache

from dtlab.errors import ConfigError
from dtlab.instruments.flops import cpu_matmul_tflops
from dtlab.predict.cluster import Cluster, shipped
from dtlab.predict.cluster_file import DTYPES
from dtlab.predict.events import Compute

_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16",
            "float": "fp32"}


def dtype_name(dtype: str) -> str:
    """bf16 | fp16 | fp32 from a config's precision or a torch dtype's name."""
    name = _ALIASES.get(dtype.removeprefix("torch."), dtype)
    if name not in DTYPES:
        raise ConfigError(f"dtype '{dtype}' has no peak in a cluster file; fix: use one of "
                          f"{', '.join(DTYPES)}")
    return name


@lru_cache(maxsize=8)
def _cpu_peak(threads: int) -> float:
    return cpu_matmul_tflops(threads)


def peak_tflops(cluster: Cluster, dtype: str, threads: int = 1) -> tuple[float, str]:
    """(TFLOP/s of one rank's device, its source); ConfigError when the file has no peak for
    the dtype."""
    name = dtype_name(dtype)
    value = cluster.peak_tflops.get(name)
    if value is None:
        where = (f"a copy of configs/clusters/{cluster.name}.yaml (pass the copy to --cluster)"
                 if shipped(cluster) else f"{cluster.path}")
        raise ConfigError(f"cluster '{cluster.name}' has no peak for {name} (it lists "
                          f"{', '.join(cluster.peak_tflops)}); fix: predict with "
                          f"train.precision={next(iter(cluster.peak_tflops))}, or add "
                          f"peak_tflops.{name} with its source to {where}")
    if value == "measure":
        return _cpu_peak(threads), (f"float32 matmul measured on this CPU now with {threads} "
                                    "thread(s)")
    return float(value), cluster.peak_source


def compute_seconds(c: Compute, cluster: Cluster, dtype: str, threads: int) -> tuple[float, str]:
    """(seconds, source) of one Compute on one rank of `cluster` alone (module docstring)."""
    if c.seconds is not None:
        return c.seconds, "measured"
    peak, source = peak_tflops(cluster, dtype, threads)
    eff = cluster.compute_efficiency
    t_flops = c.flops / (peak * 1e12 * eff)
    label = f"roofline at {100 * eff:.0f}% of {peak:.4g} TFLOP/s {dtype_name(dtype)} ({source})"
    if cluster.hbm_bytes_per_s and c.bytes > 0:
        t = max(t_flops, c.bytes / cluster.hbm_bytes_per_s)
        label += f" and {cluster.hbm_bytes_per_s / 1e9:.4g} GB/s memory"
    else:
        t = t_flops
        label += ", FLOPs only (bytes " + ("not counted)" if cluster.hbm_bytes_per_s else
                                           "bandwidth unknown)")
    return t, label

"""The node's other ranks stepping beside a traced one (predict/corun.py): how many, which clock
times the traced rank, their CPU counted as the prediction's own, and a profile that says so."""

from __future__ import annotations

import multiprocessing

import pytest

from dtlab.config import load_config
from dtlab.predict.corun import beside, cpu_clock, helpers_beside
from dtlab.predict.events import Compute
from dtlab.predict.profile import Profile


@pytest.mark.parametrize(("ranks", "cores", "threads", "clock", "helpers"), [
    (4, 2, 1, True, 3),  # ranks outnumber the cores: the whole node beside, the CPU clock
    (2, 2, 1, False, 1),  # a core each: the other rank beside, the wall clock
    (4, 2, 2, False, 0),  # threads that fill the cores: no core for another, the wall clock
    (1, 2, 2, False, 0),
    (8, None, 1, False, 0),  # a device per rank (GPUs): nothing beside
])
def test_who_steps_beside_the_traced_rank_and_on_which_clock(
        ranks: int, cores: int | None, threads: int, clock: bool, helpers: int) -> None:
    """Where ranks of one thread outnumber the cores, every other rank of the node steps beside
    the traced one and its compute is read on its thread's CPU clock (the simulator adds the
    waiting for a core); elsewhere as many as the cores leave room for, on the wall clock."""
    assert cpu_clock(ranks, cores, threads) is clock
    assert helpers_beside(ranks, cores, threads) == helpers


def test_the_helpers_cpu_counts_their_whole_life() -> None:
    """The helpers' CPU seconds (which the machine-load check does not count as other
    processes') are the kernel's account of them, start and exit included, and none is left
    running."""
    cfg = load_config(None, ["strategy.name=ddp"])
    with beside(cfg, 2, 0, 2, 1, 1) as helpers:
        procs = multiprocessing.active_children()
    assert procs and not any(p.is_alive() for p in procs)
    assert helpers.cpu_s > 0.3  # it imported torch and stepped a model: far more than that


@pytest.mark.parametrize(("clock", "said"), [
    ("thread cpu", "profile, on a thread's CPU clock beside 3 other rank(s) sharing its cores"),
    ("wall", "profile")])
def test_a_profile_says_when_its_seconds_were_timed_on_shared_cores(clock: str, said: str) -> None:
    """A profile measured where ranks outnumbered the cores carries their time-slicing in its
    seconds; a prediction priced from it says so in its compute's source."""
    profile = Profile({"clock": clock, "beside": 3}, {"ddp": {("forward", 0): [0.004, 1e6, 0.0]}})
    assert profile.seconds(Compute("forward", 0, None, 2e6), "ddp") == (
        pytest.approx(0.008), said + ", scaled by FLOPs")

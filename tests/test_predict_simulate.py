"""dtlab predict's simulator on hand-built traces: overlap, exposure, pipeline bubbles, refusals."""

from __future__ import annotations

import itertools
import time

import pytest

from dtlab.errors import DtlabError
from dtlab.predict.events import Compute, Issue, Trace, Wait
from dtlab.predict.simulate import simulate

WORLD = 8


def comp(seconds: float, phase: str = "forward", block: int | None = None, micro: int = 0
         ) -> Compute:
    return Compute(phase, block, seconds=seconds, micro=micro)


def coll(id_: int, seconds: float, op: str = "all_reduce", group: tuple[int, ...] = tuple(range(WORLD)),
         phase: str = "backward") -> Issue:
    """A collective whose price (comm_s below) is its bytes in milliseconds."""
    return Issue(id_, op, round(seconds * 1000), group, phase)


def comm_s(issue: Issue) -> tuple[float, str]:
    return issue.bytes / 1000, "intra"


def compute_s(c: Compute) -> float:
    return c.seconds


def run(events_by_rank: dict[int, list], slowdown: float = 0.0, streams: str = "rank"):
    traces = {r: Trace(rank=r, world=WORLD, events=ev) for r, ev in events_by_rank.items()}
    return simulate(traces, compute_s, comm_s, slowdown, collective_streams=streams)


def accounted(tl) -> float:
    return sum(tl.split.values()) + sum(tl.exposed.values())


def test_no_communication_step_is_sum_of_compute():
    """Without communication the step is the sum of the compute, split by phase."""
    tl = run({0: [comp(1.0), comp(2.0, "backward"), comp(0.5, "optimizer"), comp(0.25, "other")]})
    assert tl.step_s == pytest.approx(3.75)
    assert tl.split == pytest.approx({"forward": 1.0, "backward": 2.0, "recompute": 0.0,
                                      "optimizer": 0.5, "other": 0.25, "bubble": 0.0})
    assert tl.exposed == {} and tl.busy == {} and tl.per_rank_s == {0: pytest.approx(3.75)}


def ddp_step(bucket_compute: float, bucket_comm: float, buckets: int = 4) -> list:
    events = [comp(1.0)]
    for i in range(buckets):
        events += [comp(bucket_compute, "backward"), coll(i, bucket_comm)]
    return events + [Wait(i) for i in range(buckets)] + [comp(0.2, "optimizer")]


def test_ddp_buckets_overlap_the_backward_only_the_last_tail_exposed():
    """DDP-like bucket all-reduces issued during the backward hide behind it; only the last bucket's all-reduce is exposed."""
    tl = run({0: ddp_step(0.5, 0.3)})
    assert tl.step_s == pytest.approx(1.0 + 4 * 0.5 + 0.3 + 0.2)
    assert tl.exposed == pytest.approx({"all_reduce@intra": 0.3})
    assert tl.busy == pytest.approx({"all_reduce@intra": 1.2})
    assert accounted(tl) == pytest.approx(tl.step_s)


def test_ddp_buckets_slower_than_backward_queue_on_one_stream():
    """Bucket all-reduces longer than the backward between them queue in order on the rank's collective stream."""
    tl = run({0: ddp_step(0.5, 0.8)})
    # issued at 1.5, 2.0, 2.5, 3.0; each starts when the previous ends: 1.5 + 4 x 0.8 = 4.7
    assert tl.step_s == pytest.approx(4.7 + 0.2)
    assert tl.exposed == pytest.approx({"all_reduce@intra": 4.7 - 3.0})


def fsdp_forward(gather: float, units: int = 4) -> list:
    events = [coll(0, gather, "all_gather", phase="forward")]
    for k in range(units):
        if k + 1 < units:  # prefetch the next unit's parameters before computing this one
            events.append(coll(k + 1, gather, "all_gather", phase="forward"))
        events += [Wait(k), comp(1.0, block=k)]
    return events


def test_fsdp_prefetch_hides_the_next_all_gather_behind_this_unit():
    """FSDP-like prefetch: the all-gather of unit k+1 runs behind unit k's compute; only the first is exposed."""
    tl = run({0: fsdp_forward(0.6)})
    assert tl.step_s == pytest.approx(0.6 + 4 * 1.0)
    assert tl.exposed == pytest.approx({"all_gather@intra": 0.6})


def test_fsdp_all_gathers_longer_than_a_unit_expose_the_difference():
    """FSDP-like all-gathers longer than a unit's compute expose their excess on every unit."""
    tl = run({0: fsdp_forward(1.5)})
    assert tl.step_s == pytest.approx(4 * 1.5 + 1.0)
    assert tl.exposed == pytest.approx({"all_gather@intra": 4 * 1.5 + 1.0 - 4.0})
    assert accounted(tl) == pytest.approx(tl.step_s)


def test_tensor_parallel_issue_then_wait_is_fully_exposed():
    """TP-like: a collective waited for right after its issue is fully exposed."""
    events = []
    for k in range(3):
        events += [comp(1.0, block=k), coll(k, 0.25, phase="forward"), Wait(k)]
    tl = run({0: events})
    assert tl.step_s == pytest.approx(3.75)
    assert tl.exposed == pytest.approx({"all_reduce@intra": 0.75})


def test_overlap_slowdown_stretches_compute_only_while_comm_is_in_flight():
    """overlap_slowdown stretches compute only for the part that overlaps communication in flight."""
    overlapped = run({0: [coll(0, 4.0), comp(10.0, "backward"), Wait(0)]}, slowdown=0.5)
    # 4 s at 1/1.5 speed do 2.667 s of work; the 7.333 s left run at full speed
    assert overlapped.step_s == pytest.approx(4.0 + 10.0 - 4.0 / 1.5)
    assert overlapped.slowdown_s == pytest.approx(4.0 - 4.0 / 1.5)
    assert accounted(overlapped) == pytest.approx(overlapped.step_s)
    after = run({0: [comp(10.0, "backward"), coll(0, 4.0), Wait(0)]}, slowdown=0.5)
    assert after.step_s == pytest.approx(14.0) and after.slowdown_s == 0.0
    longer = run({0: [coll(0, 10.0), comp(2.0, "backward"), Wait(0)]}, slowdown=0.5)
    assert longer.step_s == pytest.approx(10.0)
    assert longer.exposed == pytest.approx({"all_reduce@intra": 10.0 - 3.0})


def test_collective_starts_when_every_traced_member_issued_it():
    """A collective starts when the last traced member issues it, and only then slows the first member's compute."""
    pair = (0, 1)
    tl = run({0: [coll(0, 4.0, group=pair), comp(10.0), Wait(0)],
              1: [comp(3.0), coll(0, 4.0, group=pair), Wait(0)]}, slowdown=0.5)
    # rank 0: 3 s at full speed, then 4 s at 1/1.5 while the all-reduce runs (3..7), then the rest
    assert tl.per_rank_s[0] == pytest.approx(3.0 + 4.0 + (10.0 - 3.0 - 4.0 / 1.5))
    assert tl.per_rank_s[1] == pytest.approx(7.0)
    assert tl.slowest_rank == 0 and tl.step_s == tl.per_rank_s[0]
    assert tl.bubble_per_rank[1] == pytest.approx(tl.step_s - 7.0)


def test_collectives_of_different_groups_queue_on_one_stream_per_rank():
    """By default a rank's collectives of different groups run in issue order; per group they overlap."""
    events = [coll(0, 3.0, "reduce_scatter", group=(0, 2)), comp(1.0, "backward"),
              coll(1, 0.5, group=(0, 1)), Wait(1), Wait(0)]
    fifo = run({0: events})
    # the all-reduce starts when the reduce-scatter ends (3.0), issued at 1.0: 2.5 s exposed
    assert fifo.step_s == pytest.approx(3.5)
    assert fifo.exposed == pytest.approx({"all_reduce@intra": 2.5})
    apart = run({0: events}, streams="group")
    assert apart.step_s == pytest.approx(3.0)
    assert apart.exposed == pytest.approx({"all_reduce@intra": 0.5, "reduce_scatter@intra": 1.5})


def test_exchange_both_sending_first_completes():
    """Two ranks that both send before they receive complete (a channel per peer, as NCCL groups them)."""
    def side(me: int, peer: int) -> list:
        return [Issue(0, "send", 1000, (me, peer)), Issue(1, "recv", 1000, (peer, me)), Wait(0),
                Wait(1), comp(1.0)]

    tl = run({0: side(0, 1), 1: side(1, 0)})
    assert tl.step_s == pytest.approx(2.0)
    assert tl.exposed == pytest.approx({"send@intra": 1.0})


def pipeline(schedule: dict[int, list[tuple[str, int, int]]], stages: int, ranks: int,
             fwd: float, bwd: float) -> dict[int, list]:
    """Events of a pipeline schedule: per rank, (F|B, virtual stage, microbatch) in order; stage s
    lives on rank s % ranks; activations and gradients move by zero-cost send/recv."""
    out = {}
    for rank, actions in schedule.items():
        ids, events, sends = itertools.count(), [], []
        for kind, s, mb in actions:
            src = s - 1 if kind == "F" else s + 1
            dst = s + 1 if kind == "F" else s - 1
            if 0 <= src < stages:
                i = next(ids)
                events += [Issue(i, "recv", 0, (src % ranks, rank)), Wait(i)]
            phase = "forward" if kind == "F" else "backward"
            events.append(comp(fwd if kind == "F" else bwd, phase, block=s, micro=mb))
            if 0 <= dst < stages:
                sends.append(next(ids))
                events.append(Issue(sends[-1], "send", 0, (rank, dst % ranks)))
        out[rank] = events + [Wait(i) for i in sends]
    return out


def gpipe(p: int, m: int) -> dict:
    return {r: [("F", r, mb) for mb in range(m)] + [("B", r, mb) for mb in range(m)]
            for r in range(p)}


def one_f_one_b(p: int, m: int) -> dict:
    out = {}
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [("F", r, mb) for mb in range(warm)]
        for i in range(m - warm):
            acts += [("F", r, warm + i), ("B", r, i)]
        out[r] = acts + [("B", r, mb) for mb in range(m - warm, m)]
    return out


def interleaved(p: int, m: int, v: int) -> dict:
    """Depth-first interleaving: microbatches in groups of p through each of the rank's v stages."""
    out = {}
    for r in range(p):
        chunks = [r + p * c for c in range(v)]
        groups = [range(g, g + p) for g in range(0, m, p)]
        fwd = [("F", s, mb) for g in groups for s in chunks for mb in g]
        bwd = [("B", s, mb) for g in groups for s in reversed(chunks) for mb in g]
        out[r] = fwd + bwd
    return out


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_pipeline_step_is_m_plus_p_minus_1_stage_times(schedule, p, m):
    """GPipe and 1F1B with equal stages and free sends: step = (m + p - 1) stage times, bubble (p - 1) per rank."""
    fwd, bwd = 1.0, 2.0
    tl = run(pipeline(schedule(p, m), p, p, fwd, bwd))
    assert tl.step_s == pytest.approx((m + p - 1) * (fwd + bwd))
    assert tl.bubble_per_rank == pytest.approx({r: (p - 1) * (fwd + bwd) for r in range(p)})
    assert tl.split["bubble"] == pytest.approx((p - 1) * (fwd + bwd))
    assert tl.exposed == {} and accounted(tl) == pytest.approx(tl.step_s)


def test_interleaved_pipeline_shrinks_the_bubble_by_the_chunks():
    """An interleaved schedule (2 stages per rank) has a smaller step: bubble (p - 1) stage times / v."""
    p, m, v, fwd, bwd = 2, 4, 2, 1.0, 2.0
    tl = run(pipeline(interleaved(p, m, v), p * v, p, fwd / v, bwd / v))
    assert tl.step_s == pytest.approx(m * (fwd + bwd) + (p - 1) * (fwd + bwd) / v)
    assert tl.step_s < run(pipeline(gpipe(p, m), p, p, fwd, bwd)).step_s


def test_recv_wait_splits_into_bubble_and_exposed_transfer():
    """A recv's wait is bubble until the peer issues its send, then exposed p2p for the transfer."""
    tl = run({0: [comp(2.0), Issue(0, "send", 500, (0, 1)), Wait(0)],
              1: [Issue(0, "recv", 500, (0, 1)), Wait(0), comp(1.0)]})
    assert tl.per_rank_s == pytest.approx({0: 2.5, 1: 3.5})
    assert tl.split["bubble"] == pytest.approx(2.0)
    assert tl.exposed == pytest.approx({"recv@intra": 0.5})
    assert tl.busy == pytest.approx({"recv@intra": 0.5})


def test_wait_without_a_matching_issue_is_refused():
    """A wait for a collective that a traced member never issues is one DtlabError naming the rank and the event."""
    with pytest.raises(DtlabError, match=r"^predict: rank 0 waits at event 2 for all_reduce #1 on "
                                         r"group \(0, 1\), but rank 1 never issues it; .*not a hang"):
        run({0: [comp(1.0), coll(7, 1.0, group=(0, 1)), Wait(7)], 1: [comp(1.0)]})


def test_unwaited_unmatched_issue_is_refused():
    """A collective issued but never matched, even unwaited, keeps the step from ending: refused."""
    with pytest.raises(DtlabError, match="rank 0 ends its step with unfinished all_gather #1"):
        run({0: [coll(0, 1.0, "all_gather", group=(0, 1))], 1: []})


def test_send_recv_cycle_is_refused():
    """Two ranks that each wait for the other's send before sending are a cycle: refused, not a hang."""
    def side(me: int, peer: int) -> list:
        return [Issue(0, "recv", 1, (peer, me)), Wait(0), Issue(1, "send", 1, (me, peer))]

    with pytest.raises(DtlabError, match=r"rank 0 waits at event 1 for message #1 from rank 1 to "
                                         r"rank 0, but rank 1 would issue it only after .*a cycle"):
        run({0: side(0, 1), 1: side(1, 0)})


def test_wait_queued_behind_a_call_that_never_starts_is_refused():
    """A wait for a call queued behind one that a member never issues names both calls."""
    with pytest.raises(DtlabError, match=r"rank 0 waits at event 2 for all_reduce #1 on group "
                                         r"\(0, 2\), but it is queued behind all_reduce #1 on "
                                         r"group \(0, 1\), which never starts"):
        run({0: [coll(0, 1.0, group=(0, 1)), coll(1, 1.0, group=(0, 2)), Wait(1)], 1: []})


@pytest.mark.parametrize("events,message", [
    ([Wait(3)], "rank 0's event 0 waits for call 3, which it never issued"),
    ([coll(0, 1.0, group=(1, 2))], r"rank 0's event 0 is a all_reduce on group \(1, 2\), which "
                                    "does not contain it"),
    ([Issue(0, "send", 1, (1, 0))], "is a send with .* which does not name it"),
])
def test_malformed_trace_is_refused(events, message):
    """A wait for an unknown call, or a call whose group leaves out its rank, is refused with one line."""
    with pytest.raises(DtlabError, match=message):
        run({0: events})


def test_ranks_disagreeing_on_a_collective_are_refused():
    """Ranks whose n-th call on a group is a different collective are refused, naming the rank."""
    with pytest.raises(DtlabError, match=r"rank 1's event 0 is all_gather #1 on group \(0, 1\) "
                                         "but another rank made that call a all_reduce"):
        run({0: [coll(0, 1.0, group=(0, 1))], 1: [coll(0, 1.0, "all_gather", group=(0, 1))]})


def test_64_ranks_of_10k_events_simulate_well_under_a_second():
    """64 traced ranks, 10^4 events in all (bucketed all-reduces on one group), simulate in well
    under a second of this process's CPU (40 ms on the 2-core CI host on 2026-12-02: a 25x margin;
    CPU time, so that the other test workers' load does not count)."""
    events = []
    for k in range(40):
        events += [comp(0.01, "backward", block=k), coll(k, 0.005, group=tuple(range(64))),
                   comp(0.001, "backward")]
    events += [Wait(k) for k in range(40)]
    traces = {r: events for r in range(64)}
    start = time.process_time()
    tl = run(traces, slowdown=0.1)
    elapsed = time.process_time() - start
    assert sum(len(e) for e in traces.values()) == 64 * 160
    assert tl.step_s > 40 * 0.011 and elapsed < 1.0


# ------------------------------------------------------------------- ranks sharing a host's cores
def shared_run(events_by_rank: dict[int, list], cores: int, ranks_per_node: int, world: int,
               slowdown: float = 0.0):
    from dtlab.predict.cores import CoreShare

    traces = {r: Trace(rank=r, world=world, events=ev) for r, ev in events_by_rank.items()}
    share = CoreShare(cores, 1, ranks_per_node, world, traces)
    return simulate(traces, compute_s, comm_s, slowdown, cores=share)


def test_symmetric_ranks_on_too_few_cores_compute_at_their_share():
    """One traced rank standing for 4 ranks of 1 thread on 2 cores computes 2x slower than alone;
    on 4 cores, or on a node of its own, at full speed."""
    events = {0: [comp(1.0), comp(2.0, "backward")]}
    assert shared_run(events, cores=2, ranks_per_node=4, world=4).step_s == pytest.approx(6.0)
    assert shared_run(events, cores=4, ranks_per_node=4, world=4).step_s == pytest.approx(3.0)
    assert shared_run(events, cores=2, ranks_per_node=1, world=4).step_s == pytest.approx(3.0)


def test_a_rank_waiting_leaves_the_cores_to_the_others():
    """Two traced ranks on one core: while both compute each runs at half speed; when one
    stops (its work done, or waiting for a message), the other runs at full speed."""
    tl = shared_run({0: [comp(1.0)], 1: [comp(3.0)]}, cores=1, ranks_per_node=2, world=2)
    # both at half speed for 2 s (1 s of work each), then rank 1 alone for its last 2 s of work
    assert tl.per_rank_s == {0: pytest.approx(2.0), 1: pytest.approx(4.0)}
    send = Issue(1, "send", 1000, (0, 1), "forward")
    recv = Issue(1, "recv", 1000, (0, 1), "forward")
    tl = shared_run({0: [comp(1.0), send, Wait(1)], 1: [recv, Wait(1), comp(1.0)]},
                    cores=1, ranks_per_node=2, world=2)
    # rank 1 waits for rank 0's 1 s of work and the 1 s message: neither shares a core
    assert tl.per_rank_s[1] == pytest.approx(3.0) and tl.split["bubble"] == pytest.approx(1.0)


def phased_run(events: list, correlation: float):
    """One traced rank standing for 4 ranks of 1 thread on 2 cores, its duty cycle iterated to
    the fixed point (host.simulate_shared)."""
    from dtlab.predict.cores import CoreShare
    from dtlab.predict.host import simulate_shared

    traces = {0: Trace(rank=0, world=4, events=events)}
    share = CoreShare(2, 1, 4, 4, traces, correlation=correlation)
    return simulate_shared(lambda c: simulate(traces, compute_s, comm_s, 0.0, cores=c), share)


def test_ranks_out_of_phase_share_the_cores_by_their_duty_cycle():
    """1 s of compute, then a 1 s collective. In lockstep (correlation 1) the 4 ranks compute
    together at half speed: 2 + 1 s. Out of phase (0) each of the 3 others computes a fraction
    d = C / (C + 1) of the time, so C = (1 + 3d) / 2: 2C^2 - 2C - 1 = 0, C = (1 + sqrt 3) / 2.
    Halfway (0.5) the step lies between the two."""
    events = [comp(1.0), coll(0, 1.0, group=(0, 1, 2, 3)), Wait(0)]
    lockstep = phased_run(events, 1.0)
    assert lockstep.step_s == pytest.approx(3.0)
    out_of_phase = phased_run(events, 0.0)
    assert out_of_phase.step_s == pytest.approx((1 + 3 ** 0.5) / 2 + 1.0, abs=2e-3)
    assert out_of_phase.split["forward"] == pytest.approx((1 + 3 ** 0.5) / 2, abs=2e-3)
    assert lockstep.step_s > phased_run(events, 0.5).step_s > out_of_phase.step_s


def test_ranks_that_only_compute_share_the_cores_alike_in_any_phase():
    """Without a wait the duty cycle is 1: every rank always computes, whatever their phase, and
    4 ranks on 2 cores take twice as long as alone."""
    events = [comp(1.0), comp(2.0, "backward")]
    assert phased_run(events, 0.0).step_s == pytest.approx(6.0)
    assert phased_run(events, 1.0).step_s == pytest.approx(6.0)


def test_phase_correlation_by_compute_between_meetings() -> None:
    """A measured table {ms: rho} is read linearly in log(ms) between its points and held flat
    beyond them; the step's compute per traced rank picks the value (host.core_share)."""
    from types import SimpleNamespace

    from dtlab.predict.cores import correlation_at
    from dtlab.predict.host import core_share

    table = {2.0: 0.0, 8.0: 0.2, 32.0: 0.6}
    assert correlation_at(0.3, 100.0) == 0.3
    assert correlation_at(table, 1.0) == 0.0 and correlation_at(table, 500.0) == 0.6
    assert correlation_at(table, 4.0) == pytest.approx(0.1)  # halfway in log(ms)
    assert correlation_at(table, 16.0) == pytest.approx(0.4)
    cluster = SimpleNamespace(cores=2, phase_correlation=table, phase_correlation_source="test")
    traces = {0: Trace(rank=0, world=4, events=[comp(0.002), comp(0.002, "backward"),
                                                 coll(0, 0.001, group=(0, 1, 2, 3)), Wait(0)])}
    notes: list[str] = []
    share = core_share(cluster, 1, 4, 4, traces, notes, compute_s)
    assert share.correlation == pytest.approx(0.1)  # 4 ms of compute a step
    assert "phase correlation 0.10 at 4 ms of compute a step (test)" in notes[0]
    # a cluster file's long source: its first clause in the note, as the table's other sources
    cluster.phase_correlation_source = ("measured here 20:37 with sync_cost.py: the Pearson "
                                        "correlation of two ranks' computing, " + "x " * 100)
    notes.clear()
    core_share(cluster, 1, 4, 4, traces, notes, compute_s)
    assert notes[0].endswith("a step (measured here 20:37 with sync_cost.py)")


def test_phase_correlation_of_measured_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/sync_cost.py's measure of the cluster file's phase_correlation: two ranks
    computing 2 s of every 4 s, in step (1), in turn (-1), or a quarter apart (0: the second
    computes half the time whether the first does or not)."""
    from conftest import ROOT

    monkeypatch.syspath_prepend(ROOT / "benchmarks")
    from sync_cost import phase_correlation

    def every_4s(offset: float) -> list[tuple[float, float]]:
        return [(4.0 * k + offset, 4.0 * k + offset + 2.0) for k in range(10)]

    assert phase_correlation([every_4s(0.0), every_4s(0.0)]) == pytest.approx(1.0)
    assert phase_correlation([every_4s(0.0), every_4s(2.0)]) == pytest.approx(-1.0, abs=0.03)
    assert phase_correlation([every_4s(0.0), every_4s(1.0)]) == pytest.approx(0.0, abs=0.03)


def test_sharing_and_overlap_slowdown_multiply():
    """A rank at half its core's share that overlaps a collective runs (1 + slowdown) x 2 slower
    meanwhile; the overlap's part alone is reported as slowdown_s."""
    events = {0: [coll(0, 1.0), comp(1.0, "backward"), Wait(0)]}
    tl = shared_run(events, cores=1, ranks_per_node=2, world=2, slowdown=0.5)
    # 1 s of comm: 1/3 s of work at 3x; then 2/3 s of work at 2x alone
    assert tl.step_s == pytest.approx(1.0 + 4 / 3)
    assert tl.slowdown_s == pytest.approx(1.0 / 3)


def test_communication_runs_slower_while_its_rank_computes():
    """A collective in flight while its rank computes runs (1 + comm_slowdown) x slower; once the
    rank waits for it, at full speed: 1 s of work, 0.5 s overlapped at 3x, the rest after."""
    traces = {0: Trace(rank=0, world=WORLD, events=[coll(0, 1.0), comp(1.5), Wait(0)])}
    tl = simulate(traces, compute_s, comm_s, 0.0, comm_slowdown=2.0)
    # in 1.5 s of compute the call does 0.5 s of its work; its last 0.5 s run alone
    assert tl.step_s == pytest.approx(2.0)
    assert tl.exposed == {"all_reduce@intra": pytest.approx(0.5)}
    assert tl.busy == {"all_reduce@intra": pytest.approx(2.0)}
    plain = simulate(traces, compute_s, comm_s, 0.0)
    assert plain.step_s == pytest.approx(1.5) and plain.exposed == {}


def test_two_lanes_run_back_to_back_collectives_together():
    """With two collectives in flight at once (gloo's two threads), four calls issued back to
    back take two calls' time; with one lane (NCCL's stream), four."""
    events = {0: [coll(i, 1.0) for i in range(4)] + [Wait(i) for i in range(4)]}
    traces = {r: Trace(rank=r, world=WORLD, events=ev) for r, ev in events.items()}
    assert simulate(traces, compute_s, comm_s, lanes=2).step_s == pytest.approx(2.0)
    assert simulate(traces, compute_s, comm_s).step_s == pytest.approx(4.0)

"""The events of the traced ranks on compute and communication streams: one step as a timeline.

Each traced rank has one **compute stream**: its Compute events in program order, each taking
compute_s(event) seconds, stretched by (1 + overlap_slowdown) for the part that runs while any
communication of that rank is in flight (kernels that share SMs and memory bandwidth with NCCL's
run slower; the factor is a named parameter, measured where dtlab can measure it).

**Issue** is asynchronous: at the compute stream's current time the call joins a FIFO on the
rank's communication side and the compute stream goes on.
  - Collectives: one FIFO stream per rank. A collective starts when every *traced* member of its
    group has issued it and it is first on each member's stream; members that are not traced are
    assumed symmetric (they arrive with the traced ones). Calls are matched across ranks by (group,
    n-th call on that group). It lasts comm_s(issue)[0]. One FIFO per rank keeps the order the rank
    issued its calls in, which is also the order of data dependencies a trace cannot show (HSDP's
    all-reduce of a reduce-scatter's output, issued with no wait between them), and collectives
    that run at once share the links, so two together take about as long as both in turn. Its
    cost: collectives of different process groups never overlap (a TP all-reduce queues behind an
    FSDP reduce-scatter that NCCL would run beside it, on its own communicator's stream).
    collective_streams="group" gives each process group its own FIFO instead (ProcessGroupNCCL's
    stream per communicator): groups then overlap freely, sharing no bandwidth, ordered by nothing.
  - send/recv: matched by (src, dst, n-th message from src to dst). Each ordered pair of ranks has
    its own FIFO channel; the transfer starts when both sides have issued it (NCCL's rendezvous)
    and the channel is free. A channel per peer rather than one p2p stream per rank: NCCL keeps a
    connection per peer and a pipeline schedule posts its sends and receives as a group
    (batch_isend_irecv), so one FIFO per rank would serialise, and can deadlock, exchanges that run
    together. A peer that is not traced is assumed to issue its side with the traced one.

**Wait(id)** stops the compute stream until that call has finished. The time stopped is *exposed*
communication, keyed "op@tier" (tier = comm_s(issue)[1]); for a send or recv, the part spent
waiting for the peer to issue its side is pipeline **bubble** instead. When its events run out a
rank still waits for every call it issued (in the order they finish, each interval exposed to the
call that ends it): the step ends when every stream of every traced rank is idle, and step_s is the
latest rank's end. A rank that ends earlier than the step counts the rest as bubble (a pipeline
stage waiting for the others).

split, exposed and busy describe the **slowest** rank, so that sum(split) + sum(exposed) ==
step_s: compute seconds by phase (including the overlap stretch, also given alone as slowdown_s)
and "bubble"; exposed {op@tier: s}; busy {op@tier: s} (seconds its communication was in flight,
hidden or not; calls in flight together each count). spans: (rank, stream, label, start, end) for
a plot, stream "compute", "comm" or "p2p" (spans of different peers, or of different groups under
collective_streams="group", may overlap), waits as "wait op@tier" and "bubble" on "compute".

A Wait that can never complete (no matching issue on a traced rank, ops that disagree, a cycle)
raises DtlabError naming the rank and the event: a bug in a trace, never a hang. The simulation is
a discrete-event sweep over a heap of finish times, linear in the number of events.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping

from dtlab.errors import DtlabError
from dtlab.predict.calls import Calls
from dtlab.predict.cores import CoreShare
from dtlab.predict.events import Compute, Issue, Trace, Wait
from dtlab.predict.timeline import Call, RankState, Span, Stream, Timeline

__all__ = ["Span", "Timeline", "simulate"]

def simulate(traces: Mapping[int, Trace], compute_s: Callable[[Compute], float],
             comm_s: Callable[[Issue], tuple[float, str]], overlap_slowdown: float = 0.0,
             *, collective_streams: str = "rank", cores: CoreShare | None = None,
             comm_slowdown: float = 0.0, lanes: int = 1) -> Timeline:
    """One step of the traced ranks (module docstring); DtlabError on a trace that cannot end.
    collective_streams: "rank" (one FIFO per rank, the default) or "group" (one per process
    group), see the module docstring. cores: the ranks of a node share its cores (cores.py);
    None: every rank has its own device. comm_slowdown: a call runs (1 + this) x slower while a
    traced rank it involves computes (on a CPU gloo's threads get what the compute leaves).
    lanes: collectives a rank's stream runs at once (gloo's worker threads per process group;
    NCCL: 1, a stream per communicator), started in the order issued."""
    if not traces:
        raise DtlabError("predict: no trace to simulate (the tracer returned no rank)")
    if collective_streams not in ("rank", "group"):
        raise ValueError(f"collective_streams must be 'rank' or 'group', not {collective_streams!r}")
    if not (overlap_slowdown >= 0 and comm_slowdown >= 0):
        raise DtlabError(f"predict: overlap slowdowns ({overlap_slowdown}, {comm_slowdown}) "
                         "must be >= 0")
    return _Simulation(traces, compute_s, comm_s, overlap_slowdown,
                       collective_streams == "group", cores, 1.0 + comm_slowdown, lanes).run()


class _Simulation(Calls):
    def __init__(self, traces: Mapping[int, Trace], compute_s: Callable[[Compute], float],
                 comm_s: Callable[[Issue], tuple[float, str]], overlap_slowdown: float,
                 per_group: bool, cores: CoreShare | None, comm_stretch: float,
                 lanes: int) -> None:
        self.compute_s, self.comm_s, self.cores = compute_s, comm_s, cores
        self.comm_stretch = comm_stretch
        self.in_flight: set[Call] = set()
        self.stretch = 1.0 + overlap_slowdown
        self.ranks = {r: RankState(r, t) for r, t in sorted(traces.items())}
        self.per_group = per_group
        self.coll = {r: Stream((r,), lanes) for r in self.ranks}
        self.lanes = lanes
        self.channels: dict[tuple, Stream] = {}  # (src, dst) of p2p; a group's, per_group
        self.ops: dict[tuple, Call] = {}
        self.heap: list[tuple[float, int, object, int]] = []
        self.seq = 0
        self.runnable: deque[RankState] = deque(self.ranks.values())
        self.spans: list[Span] = []

    def run(self) -> Timeline:
        t = 0.0
        while True:
            while self.runnable:
                self._advance(self.runnable.popleft(), t)
            if not self.heap:
                break
            t, _, item, version = heapq.heappop(self.heap)
            if isinstance(item, Call):
                if version == item.version:
                    self._finish_op(item, t)
            elif version == item.version:
                self._finish_compute(item, t)
        stuck = [st for st in self.ranks.values() if st.done_t is None]
        if stuck:
            raise DtlabError(self._why(stuck[0]))
        return self._timeline()

    # -- the compute stream --------------------------------------------------------------------
    def _advance(self, st: RankState, t: float) -> None:
        """Run rank `st` from time t until a Compute is under way, a Wait stops it, or its end."""
        events = st.events
        while st.pos < len(events):
            e = events[st.pos]
            st.pos += 1
            if isinstance(e, Compute):
                seconds = self.compute_s(e)
                if not seconds >= 0:
                    raise DtlabError(f"predict: compute time {seconds} for rank {st.rank}'s "
                                     f"event {st.pos - 1} ({e.phase}); it must be >= 0")
                if seconds == 0:
                    continue
                self._restretch_calls(st.rank, t, computes=True)
                st.remaining, st.t_last, st.current = seconds, t, (e, t)
                self._reshare(st, t, +1)
                self._schedule(st, t)
                return
            if isinstance(e, Issue):
                self._issue(st, e, t)
            elif isinstance(e, Wait):
                op = st.ids.get(e.id)
                if op is None:
                    raise DtlabError(f"predict: rank {st.rank}'s event {st.pos - 1} waits for call "
                                     f"{e.id}, which it never issued before: a bug in the trace")
                if not op.done:
                    st.blocked, st.block_t = op, t
                    op.waiters.append(st)
                    return
        st.draining, st.block_t = True, t
        if st.outstanding == 0:
            st.done_t = t

    def _schedule(self, st: RankState, t: float) -> None:
        st.version += 1
        st.stretched = self.stretch if st.busy else 1.0
        st.factor = st.stretched * (self.cores.factor(st.rank) if self.cores else 1.0)
        self._push(t + st.remaining * st.factor, st, st.version)

    def _settle(self, st: RankState, t: float) -> None:
        """Bring the current Compute's remaining work up to time t at the rate it ran at."""
        if st.remaining is None:
            return
        elapsed = t - st.t_last
        st.remaining -= elapsed / st.factor
        st.slow += elapsed - elapsed / st.stretched  # the overlap's part of the time
        st.t_last = t

    def _reshare(self, st: RankState, t: float, delta: int) -> None:
        """`st` starts (+1) or stops (-1) computing: its node's other computing ranks go on at
        their new share of the cores from t."""
        if self.cores is None:
            return
        peers = [p for p in self.ranks.values() if p is not st and p.remaining is not None
                 and self.cores.same_node(p.rank, st.rank)]
        for p in peers:
            self._settle(p, t)
        self.cores.computing[self.cores.node_of[st.rank]] += delta
        for p in peers:
            self._schedule(p, t)

    def _set_busy(self, rank: int, delta: int, t: float) -> None:
        st = self.ranks[rank]
        was = st.busy > 0
        if st.remaining is not None and self.stretch != 1.0:
            self._settle(st, t)
        st.busy += delta
        if st.remaining is not None and self.stretch != 1.0 and was != (st.busy > 0):
            self._schedule(st, t)

    def _finish_compute(self, st: RankState, t: float) -> None:
        self._settle(st, t)
        e, start = st.current
        self._restretch_calls(st.rank, t, computes=False)
        st.remaining = st.current = None
        self._reshare(st, t, -1)
        st.phases[e.phase if e.phase in st.phases else "other"] += t - start
        label = e.phase if e.block is None else f"{e.phase} b{e.block}"
        self.spans.append((st.rank, "compute", f"{label} m{e.micro}", start, t))
        self.runnable.append(st)

    def _push(self, t: float, item: object, version: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, item, version))

    # -- results -------------------------------------------------------------------------------
    def _timeline(self) -> Timeline:
        per_rank = {r: st.done_t for r, st in self.ranks.items()}
        step = max(per_rank.values())
        slowest = max(per_rank, key=lambda r: (per_rank[r], -r))
        st = self.ranks[slowest]
        split = dict(st.phases)
        split["bubble"] = st.bubble
        bubbles = {r: s.bubble + step - s.done_t for r, s in self.ranks.items()}
        return Timeline(step_s=step, per_rank_s=per_rank, split=split,
                        exposed={k: v for k, v in st.exposed.items() if v > 0},
                        busy=dict(st.comm), spans=self.spans, slowest_rank=slowest,
                        bubble_per_rank=bubbles, slowdown_s=st.slow)

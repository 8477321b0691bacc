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
from dtlab.predict.cores import CoreShare
from dtlab.predict.events import POINT_TO_POINT, Compute, Issue, Trace, Wait
from dtlab.predict.timeline import Call, RankState, Span, Stream, Timeline

__all__ = ["Span", "Timeline", "simulate"]

def _name(e: Issue, n: int) -> str:
    if e.op in POINT_TO_POINT:
        return f"message #{n} from rank {e.group[0]} to rank {e.group[1]}"
    return f"{e.op} #{n} on group {e.group}"


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


class _Simulation:
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

    # -- communication -------------------------------------------------------------------------
    def _issue(self, st: RankState, e: Issue, t: float) -> None:
        r, p2p = st.rank, e.op in POINT_TO_POINT
        if p2p and (len(e.group) != 2 or r != e.group[0 if e.op == "send" else 1]
                    or e.group[0] == e.group[1]):
            raise DtlabError(f"predict: rank {r}'s event {st.pos - 1} is a {e.op} with "
                             f"(src, dst) {e.group}, which does not name it: a bug in the trace")
        key = (e.group, e.op) if p2p else e.group  # n-th send of src to dst, n-th recv, n-th call
        n = st.counts[key] = st.counts.get(key, 0) + 1
        match = (e.group, n, p2p)
        op = self.ops.get(match)
        if op is None:
            op = self.ops[match] = self._new_op(e, n)
        if r not in op.labels:
            raise DtlabError(f"predict: rank {r}'s event {st.pos - 1} is a {e.op} on group "
                             f"{e.group}, which does not contain it: a bug in the trace")
        if not p2p and op.kind != e.op:
            raise DtlabError(f"predict: rank {r}'s event {st.pos - 1} is {_name(e, n)} but "
                             f"another rank made that call a {op.kind}: the traces disagree")
        if r in op.issue_t:
            raise DtlabError(f"predict: rank {r} issues {op.name} twice: a bug in the trace")
        op.issue_t[r] = t
        st.ids[e.id] = op
        st.outstanding += 1
        if not p2p and not self.per_group:
            self.coll[r].queue.append(op)
        self._try_start(op, t)

    def _new_op(self, e: Issue, n: int) -> Call:
        name = _name(e, n)
        seconds, tier = self.comm_s(e)
        if not seconds >= 0:
            raise DtlabError(f"predict: communication time {seconds} for {name}; it must be >= 0")
        p2p = e.op in POINT_TO_POINT
        members = tuple(r for r in e.group if r in self.ranks)
        if p2p or self.per_group:  # one stream shared by the members, in call order
            key = (e.group, p2p)
            channel = self.channels.get(key)
            if channel is None:
                channel = self.channels[key] = Stream(members, 1 if p2p else self.lanes)
            channel.queue.append(op := Call(e, name, members, seconds, tier, [channel]))
        else:
            op = Call(e, name, members, seconds, tier, [self.coll[r] for r in members])
        op.labels = ({e.group[0]: f"send@{tier}", e.group[1]: f"recv@{tier}"} if p2p else
                     dict.fromkeys(members, f"{e.op}@{tier}"))
        return op

    def _try_start(self, op: Call, t: float) -> None:
        if op.start is not None or len(op.issue_t) < len(op.members):
            return
        for s in op.streams:
            if len(s.running) >= s.lanes or s.queue[0] is not op:
                return
        op.start, op.remaining, op.t_last = t, op.seconds, t
        for s in op.streams:
            s.queue.popleft()
            s.running.append(op)
            for r in s.ranks:
                self._set_busy(r, 1, t)
        self.in_flight.add(op)
        self._schedule_call(op, t)

    def _schedule_call(self, op: Call, t: float, changing: tuple[int, bool] | None = None) -> None:
        """(Re)schedule `op`'s end from t; `changing`: (a rank, whether it computes from t),
        for a rank whose state changes at t."""
        def computing(r: int) -> bool:
            if changing is not None and r == changing[0]:
                return changing[1]
            return self.ranks[r].remaining is not None

        op.version += 1
        op.factor = self.comm_stretch if any(computing(r) for r in op.members) else 1.0
        self._push(t + op.remaining * op.factor, op, op.version)

    def _restretch_calls(self, rank: int, t: float, computes: bool) -> None:
        """`rank` starts or stops computing at t: its calls in flight went at their rate until
        t, and go on at the new one."""
        if self.comm_stretch == 1.0:
            return
        for op in [op for op in self.in_flight if rank in op.members]:
            op.remaining -= (t - op.t_last) / op.factor
            op.t_last = t
            self._schedule_call(op, t, (rank, computes))

    def _finish_op(self, op: Call, t: float) -> None:
        op.done = True
        self.in_flight.discard(op)
        for r in op.members:
            self.ranks[r].comm[op.labels[r]] += t - op.start
            self.spans.append((r, "p2p" if op.p2p else "comm", op.labels[r], op.start, t))
        for s in op.streams:
            s.running.remove(op)
            for r in s.ranks:
                self._set_busy(r, -1, t)
        for r in op.members:
            st = self.ranks[r]
            st.outstanding -= 1
            if st.draining and st.done_t is None:
                self._waited(st, op, st.block_t, t, bubble=0.0)
                st.block_t = t
                if st.outstanding == 0:
                    st.done_t = t
        for st in op.waiters:
            bubble = 0.0
            if op.p2p:  # the time before the peer issued its side: the pipeline's bubble
                peer_t = [v for k, v in op.issue_t.items() if k != st.rank]
                if peer_t:
                    bubble = min(max(peer_t[0] - st.block_t, 0.0), t - st.block_t)
            self._waited(st, op, st.block_t, t, bubble)
            st.blocked = None
            self.runnable.append(st)
        op.waiters = []
        for s in op.streams:
            if s.queue:
                self._try_start(s.queue[0], t)

    def _waited(self, st: RankState, op: Call, start: float, end: float, bubble: float) -> None:
        if bubble > 0:
            st.bubble += bubble
            self.spans.append((st.rank, "compute", "bubble", start, start + bubble))
        if end - start - bubble > 0:
            label = op.labels[st.rank]
            st.exposed[label] += end - start - bubble
            self.spans.append((st.rank, "compute", f"wait {label}", start + bubble, end))

    def _push(self, t: float, item: object, version: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, item, version))

    # -- results -------------------------------------------------------------------------------
    def _why(self, st: RankState) -> str:
        if st.blocked is not None:
            op, where = st.blocked, f"rank {st.rank} waits at event {st.pos - 1} for"
        else:
            op = next(o for o in self.ops.values() if st.rank in o.members and not o.done)
            where = f"rank {st.rank} ends its step with unfinished"
        missing = [m for m in op.members if m not in op.issue_t]
        if missing:
            other = self.ranks[missing[0]]
            if other.blocked is not None:
                reason = (f"rank {other.rank} would issue it only after its own event "
                          f"{other.pos - 1}, which waits for {other.blocked.name}: a cycle")
            else:
                reason = f"rank {other.rank} never issues it"
        else:
            ahead = next((s.queue[0] for s in op.streams if s.queue and s.queue[0] is not op), None)
            reason = f"it is queued behind {ahead.name}, which never starts" if ahead else \
                "it never starts"
        return (f"predict: {where} {op.name}, but {reason}; the step can never end "
                f"(a bug in the trace, not a hang)")

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

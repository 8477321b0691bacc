"""The communication side of the simulator (simulate.py's module docstring says what it models):
calls matched across the traced ranks as they issue them, started on their streams in FIFO order
(`lanes` at once), slowed while a rank they involve computes, and the waits they end.
`Calls` is a part of simulate._Simulation, whose state it uses (ranks, coll, channels, ops,
in_flight, spans, heap)."""

from __future__ import annotations

from typing import Any

from dtlab.errors import DtlabError
from dtlab.predict.events import POINT_TO_POINT, Issue
from dtlab.predict.timeline import Call, RankState, Stream


def _name(e: Issue, n: int) -> str:
    if e.op in POINT_TO_POINT:
        return f"message #{n} from rank {e.group[0]} to rank {e.group[1]}"
    return f"{e.op} #{n} on group {e.group}"


class Calls:
    """Calls: issued, matched, started, slowed, finished, waited."""

    ranks: dict[int, RankState]
    coll: dict[int, Stream]
    channels: dict[tuple, Stream]
    ops: dict[tuple, Call]
    in_flight: set[Call]
    spans: list[Any]
    comm_s: Any
    comm_stretch: float
    lanes: int
    per_group: bool
    runnable: Any
    _push: Any  # the simulation's: (time, item, version) onto its heap
    _set_busy: Any  # the simulation's: a rank's communication streams running, +1 or -1

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

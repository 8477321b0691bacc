"""The simulator's result (Timeline) and the state it keeps while it runs (simulate.py).

Stream     a FIFO of calls on the communication side: a rank's collectives, a process group's,
           or one ordered pair of ranks' messages; `ranks` are the traced ranks it keeps busy
Call       one collective or message, matched across the traced ranks that issue it
RankState  where one traced rank's compute stream is, and what its time went to
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from dtlab.predict.events import PHASES, POINT_TO_POINT, Compute, Issue, Trace

Span = tuple[int, str, str, float, float]


@dataclass
class Timeline:
    """One simulated step; simulate.py's docstring says what each number means."""

    step_s: float
    per_rank_s: dict[int, float]
    split: dict[str, float]  # PHASES + "bubble", of the slowest rank
    exposed: dict[str, float]  # "op@tier" -> seconds the slowest rank's compute stream waited
    busy: dict[str, float]  # "op@tier" -> seconds the slowest rank's communication was in flight
    spans: list[Span] = field(default_factory=list)
    slowest_rank: int = 0
    bubble_per_rank: dict[int, float] = field(default_factory=dict)
    slowdown_s: float = 0.0  # of split's compute, the stretch from overlap (slowest rank)


class Stream:
    __slots__ = ("ranks", "queue", "running", "lanes")

    def __init__(self, ranks: tuple[int, ...], lanes: int = 1) -> None:
        self.ranks = ranks  # traced ranks this stream's work keeps busy
        self.queue: deque[Call] = deque()
        self.running: list[Call] = []
        self.lanes = lanes  # calls it runs at once, started in FIFO order


class Call:
    __slots__ = ("kind", "name", "p2p", "members", "streams", "seconds", "tier", "labels",
                 "issue_t", "start", "done", "waiters", "remaining", "t_last", "factor", "version")

    def __init__(self, e: Issue, name: str, members: tuple[int, ...], seconds: float, tier: str,
                 streams: list[Stream]) -> None:
        self.kind, self.name, self.p2p = e.op, name, e.op in POINT_TO_POINT
        self.members, self.seconds, self.tier, self.streams = members, seconds, tier, streams
        self.labels: dict[int, str] = {}  # traced rank -> "op@tier" of its own side of the call
        self.issue_t: dict[int, float] = {}
        self.start: float | None = None
        self.done = False
        self.waiters: list[RankState] = []
        self.remaining = self.t_last = 0.0  # seconds of it left at its own speed, since t_last
        self.factor = 1.0  # how much slower it runs now (simulate.py's comm_slowdown)
        self.version = 0


class RankState:
    __slots__ = ("rank", "events", "pos", "ids", "counts", "busy", "remaining", "t_last",
                 "version", "current", "blocked", "block_t", "draining", "outstanding", "done_t",
                 "phases", "bubble", "exposed", "comm", "slow", "factor", "stretched")

    def __init__(self, rank: int, trace: Trace) -> None:
        self.rank, self.events, self.pos = rank, trace.events, 0
        self.ids: dict[int, Call] = {}
        self.counts: dict[tuple, int] = {}  # calls so far per group, per (src, dst) and side
        self.busy = 0  # communication streams of this rank now running
        self.remaining: float | None = None  # unstretched seconds left of the current Compute
        self.t_last = self.block_t = 0.0
        self.version = 0
        self.current: tuple[Compute, float] | None = None
        self.blocked: Call | None = None
        self.draining = False
        self.outstanding = 0
        self.done_t: float | None = None
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.bubble = self.slow = 0.0
        self.factor = self.stretched = 1.0  # how much slower than alone it computes now, and the
        # overlap's part of that (simulate.py's _schedule)
        self.exposed: dict[str, float] = defaultdict(float)
        self.comm: dict[str, float] = defaultdict(float)

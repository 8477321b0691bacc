"""`dtlab doctor hang RUN_DIR`: which rank stopped at which collective, from the flight-recorder
dumps a failed or stopped run left in RUN_DIR/flight_recorder (dtlab/instruments/flight_recorder.py).

Collectives are numbered per process group (`collective_seq_id`) in the order each rank issued
them, so in a hang the ranks that stopped taking part have the lowest last number: the next number
is the collective they never entered, and the ranks that have it are the ones that waited in it.
PyTorch's own analysis (torch.distributed.flight_recorder, what `torchfrtrace` runs) matches the
same entries across ranks; its findings are printed beside this verdict.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import json
import logging
import math
import pickle
import re
from pathlib import Path
from typing import Any

from dtlab.errors import DtlabError
from dtlab.instruments.flight_recorder import DIR, NCCL_PREFIX

ELEMENT_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4,
                 "Short": 2, "Byte": 1, "Char": 1, "Bool": 1}


class _PlainData(pickle.Unpickler):
    """NCCL's watchdog writes pickles of plain dicts, lists and numbers: anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a dump holds plain data only")


def read_dumps(run_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> its dump: dtlab's rank<r>.json, else NCCL's own nccl_rank<r> (written at a timeout)."""
    folder = run_dir / DIR
    dumps: dict[int, dict[str, Any]] = {}
    for path in sorted(folder.glob(f"{NCCL_PREFIX}*")) + sorted(folder.glob("rank*.json")):
        m = re.fullmatch(rf"(?:{NCCL_PREFIX}|rank)(\d+)(\.json)?", path.name)
        if not m:
            continue
        try:
            if path.suffix == ".json":
                dump = json.loads(path.read_text())
            else:
                with open(path, "rb") as f:
                    dump = _PlainData(f).load()
        except (OSError, ValueError, pickle.UnpicklingError, EOFError) as e:
            raise DtlabError(f"cannot read the flight-recorder dump '{path}' ({e}); fix: move it "
                             "out of the folder (a dump is plain data; one cut short by a kill, or "
                             "holding anything else, is not read)") from None
        if path.suffix != ".json" and isinstance(dump, dict) and "entries" not in dump:
            continue  # NCCL's watchdog leaves out the entries of an empty buffer
        problem = dump_problem(dump)
        if problem:
            raise DtlabError(f"'{path}' is not a flight-recorder dump ({problem}); fix: move it "
                             f"out of {folder} (a dump, written when a distributed run fails or "
                             "is stopped, is an object with version, pg_config and entries)")
        dumps[int(m.group(1))] = dump
    return dumps


# What this module reads of an entry, and the types it must have.
ENTRY = {"collective_seq_id": int, "process_group": (list, tuple), "profiling_name": str}
OPTIONAL = {"input_sizes": list, "input_dtypes": list, "time_created_ns": (int, float),
            "is_p2p": bool}
HEAD = {"time": str, "reason": str, "world_size": int}


def dump_problem(dump: Any) -> str | None:
    """What is wrong with the shape of a dump (parsed JSON or pickle), None when nothing is."""
    if not isinstance(dump, dict):
        return f"a {type(dump).__name__}, not an object"
    missing = [k for k in ("version", "pg_config", "entries") if k not in dump]
    if missing:
        return f"no {', '.join(missing)}"
    if not isinstance(dump["entries"], list) or not isinstance(dump["pg_config"], dict):
        return "entries must be a list and pg_config an object"
    if not all(isinstance(g, dict) and all(isinstance(g.get(k, ""), str) for k in ("ranks", "desc"))
               for g in dump["pg_config"].values()):
        return "pg_config must map each group to an object with its ranks and desc as text"
    for i, entry in enumerate(dump["entries"]):
        if not isinstance(entry, dict):
            return f"entry {i} is a {type(entry).__name__}, not an object"
        for key, kind in ENTRY.items():
            if not isinstance(entry.get(key), kind) or isinstance(entry.get(key), bool):
                return f"entry {i} has no {key} of type {_name(kind)}"
        for key, kind in OPTIONAL.items():
            if entry.get(key) is not None and not isinstance(entry[key], kind):
                return f"entry {i}: {key} is not of type {_name(kind)}"
        if not entry["process_group"] or not isinstance(entry["process_group"][0], str):
            return f"entry {i}: process_group must start with the group's name"
    head = dump.get("dtlab")
    if head is not None:
        if not isinstance(head, dict):
            return "its dtlab header is not an object"
        for key, kind in HEAD.items():
            if not isinstance(head.get(key), kind):
                return f"its dtlab header has no {key} of type {_name(kind)}"
        try:
            datetime.datetime.fromisoformat(head["time"])
        except ValueError:
            return f"its dtlab header's time {head['time']!r} is not an ISO time"
    return None


def _name(kind: type | tuple[type, ...]) -> str:
    return "/".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def describe(entry: dict[str, Any]) -> str:
    sizes, dtypes = entry.get("input_sizes") or [], entry.get("input_dtypes") or []
    nbytes = sum(math.prod(s) * ELEMENT_BYTES.get(d, 4) for s, d in zip(sizes, dtypes, strict=False))
    dtype = f" {dtypes[0]}" if dtypes else ""
    return f"{entry['profiling_name']}, input {sizes}{dtype} ({nbytes:,} bytes)"


def collectives_of(dump: dict[str, Any], group: str) -> dict[int, dict[str, Any]]:
    return {e["collective_seq_id"]: e for e in dump["entries"]
            if e["process_group"][0] == group and not e.get("is_p2p")}


def verdict(dumps: dict[int, dict[str, Any]], group: str,
            info: dict[str, str]) -> tuple[list[str], bool]:
    """The lines about one process group: each rank's last collective, and who stopped where;
    whether they found a culprit (a rank behind, ranks that disagree, a rank without a dump)."""
    members = [int(r) for r in re.findall(r"\d+", info.get("ranks", ""))] or sorted(dumps)
    seen = {r: collectives_of(dumps[r], group) for r in members if r in dumps}
    if not any(seen.values()):
        return [], False
    name = f"group {group} ({info.get('desc') or 'undefined'}, ranks {members})"
    lines = [f"{name}: the last collective each rank entered",
             *(f"  rank {r}: " + (f"#{max(c)} {describe(c[max(c)])}" if c else "none")
               for r, c in sorted(seen.items()))]
    missing = [r for r in members if r not in dumps]
    last = {r: max(c, default=0) for r, c in seen.items()}
    behind = sorted(r for r, n in last.items() if n == min(last.values()))
    ahead = sorted(set(last) - set(behind))
    ops = {describe(c[last[r]]) for r, c in seen.items() if c}
    if not ahead:
        lines.append(f"  all ranks entered #{min(last.values())}" + (
            ": none is behind in this group" if len(ops) == 1 else
            f", but not the same collective: the ranks disagree ({' | '.join(sorted(ops))})"))
    else:
        nxt = min(last.values()) + 1
        entry = next((seen[r][nxt] for r in ahead if nxt in seen[r]), None)
        what = describe(entry) if entry else "not in the ranks' buffers any more"
        waits = [f"rank {r} {waited(dumps[r], seen[r][nxt])}" for r in ahead if nxt in seen[r]]
        lines.append(f"  verdict: rank(s) {behind} never entered collective #{nxt} ({what}); "
                     f"rank(s) {ahead} entered it and waited for them"
                     + (f" ({', '.join(waits)})" if waits else ""))
    if missing:
        lines.append(f"  rank(s) {missing} left no dump: killed, or stuck where Python could "
                     "not run (SIGKILL, the OOM killer, a crash or a hang in C++): suspect them first")
    return lines, bool(ahead or missing or len(ops) > 1)


def waited(dump: dict[str, Any], entry: dict[str, Any]) -> str:
    """From entering the collective to the dump, when both times are known."""
    head = dump.get("dtlab")
    if not head or not entry.get("time_created_ns"):
        return "until it failed"
    seconds = datetime.datetime.fromisoformat(head["time"]).timestamp() - entry["time_created_ns"] / 1e9
    return f"{seconds:.1f} s until its dump"


def first_clause(reason: str) -> str:
    """A stop's reason without the advice that follows it (the run's output has that)."""
    return re.split(r"; see their output|\. fix: |; fix: |; no checkpoint|; last checkpoint",
                    reason)[0]


def pytorch_analysis(dumps: dict[int, dict[str, Any]]) -> list[str]:
    """PyTorch's matching of the same dumps: the collectives it found incomplete or mismatched,
    and whether it gave up (it stops after 10 mismatches in a group)."""
    # Its logger warns on import when `tabulate` is missing, and logs its findings.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from torch.distributed.flight_recorder.components.builder import build_db
        from torch.distributed.flight_recorder.components.config_manager import JobConfig

    details = {f"rank{r}": {"host_name": f"rank{r}", "rank": r, "entries": d["entries"],
                            "version": d["version"], "pg_config": d["pg_config"]}
               for r, d in dumps.items()}
    args = JobConfig().parse_args(["unused", "--allow-incomplete-ranks"])
    log, logger = io.StringIO(), logging.getLogger("Flight Recorder")
    handlers, logger.handlers = logger.handlers, [logging.StreamHandler(log)]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            db = build_db(copy.deepcopy(details), args, str(next(iter(dumps.values()))["version"]))
    except Exception as e:  # noqa: BLE001 - a format it does not know: dtlab's verdict stands
        return [f"PyTorch's flight-recorder analysis could not read these dumps: {e}"]
    finally:
        logger.handlers = handlers
    found = [f"  collective #{c.collective_seq_id} ({c.collective_name}, group {c.pg_desc}): "
             + (f"missing ranks {sorted(c.missing_ranks)}" if c.missing_ranks else
                f"mismatch: {c.type_of_mismatch}")
             for c in db.collectives if c.missing_ranks or c.type_of_mismatch]
    text = log.getvalue()
    first = re.search(r"Collective sequence number: (\d+) has errors.*?collective: (\S+).*?"
                      r"error msg: ([^\n]*)", text, re.S)
    if "Too many mismatches" in text and first:
        found.append(f"  it gave up after more than {args.mismatch_cap} mismatches, the first at "
                     f"collective #{first.group(1)} ({first.group(2)}: {first.group(3)[:160]}); "
                     "when gloo records an all-gather's output at the input's size (tensor "
                     "parallelism's, measured here) that check fails on every one of them: no "
                     "finding about this run; the sequence numbers above are")
    return ["PyTorch's flight-recorder analysis (torch.distributed.flight_recorder):",
            *(found or ["  every collective in the buffers was entered by all its ranks"])]


def report(run_dir: Path) -> str:
    dumps = read_dumps(run_dir)
    if not dumps:
        raise DtlabError(f"no flight-recorder dumps in '{run_dir / DIR}'; they are written when "
                         "a distributed run fails or is stopped; fix: pass the run directory "
                         "(run.dir) of such a run, with run.flight_recorder > 0")
    world = max(d.get("dtlab", {}).get("world_size", 0) for d in dumps.values()) or max(dumps) + 1
    lines = [f"flight recorder of {run_dir}: {len(dumps)} of {world} rank(s) dumped"]
    for r, d in sorted(dumps.items()):
        head = d.get("dtlab")
        why = f"{head['time'][:19]}Z: {first_clause(head['reason'])}" if head else "written by NCCL's watchdog"
        lines.append(f"  rank {r} ({why})")
    groups: dict[str, dict[str, str]] = {}
    for d in dumps.values():
        groups.update(d.get("pg_config") or {})
    found = False
    for group in sorted(groups, key=lambda g: (len(g), g)):
        group_lines, culprit = verdict(dumps, group, groups[group])
        lines += group_lines
        found = found or culprit
    if not found:
        lines.append("no rank is behind in the recorded collectives: the wait was in an operation "
                     "the recorder does not keep (gloo records no point-to-point send or receive, "
                     "which pipeline parallelism uses) or outside collectives; each rank's reason "
                     "above says where it stopped")
    return "\n".join(lines + pytorch_analysis(dumps))

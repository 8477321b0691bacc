"""What dtlab wrote, and may therefore replace (docs/reliability.md#what-dtlab-may-delete).

Every command that writes a directory (a run, compare, sweep, plot, report) keeps a record
there, `.dtlab-owner.json`: the kind of output, whose it is (a run's id, a sweep spec's path and
content) and the entries it wrote. A command replaces or deletes only entries its own kind and
owner recorded. Before it writes anything it claims the directory (`claim`), which is refused
in one line when
- the record names another kind or owner: the directory holds another command's output;
- an entry it is about to write exists and no record names it: the user's own file, or output
  of an older dtlab that kept no record.
Everything else in the directory is left as it is: a user's notes beside a run stay untouched.

One record, one kind and owner, per directory. Outputs that other commands add to a directory
(`dtlab report` into a sweep's or a compare's: results.csv, report.html, plots/) are not entered
in its record: a single file is replaced only over an earlier output of its kind
(`dtlab.atomic_write.check_replaceable` reads its first bytes), and plots/ is a directory of its
own, with its own record (kind "plot"). So a sweep's or a compare's record never has to admit a
second kind, and a report written there never stands in the way of their next run.

Only the standard library and the ground (`dtlab.errors`, `dtlab.files`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtlab.errors import DtlabError
from dtlab.files import describe

RECORD = ".dtlab-owner.json"


class NotOurs(DtlabError):
    """A directory, or entries in it, that this command did not write."""


def read(directory: Path) -> dict[str, Any] | None:
    """The directory's record, None when it has none (or one that cannot be read)."""
    try:
        record = json.loads((Path(directory) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("kind"), str) and \
        isinstance(record.get("entries"), list)
    return record if ok else None


@dataclass
class Owned:
    """A directory this command may write: `entries` are what it (or its earlier runs of the
    same kind and owner) recorded writing there."""

    path: Path
    kind: str
    owner: str
    entries: set[str] = field(default_factory=set)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, *names: str, **extra: Any) -> None:
        """Record entries (names directly under the directory) as written, before they are
        written: a process killed in between leaves them recorded, so that the next run may
        replace what it left. The directory is created when missing."""
        self.entries.update(names)
        self.extra.update(extra)
        record = {"kind": self.kind, "owner": self.owner, "entries": sorted(self.entries),
                  **self.extra}
        target = self.path / RECORD
        tmp = self.path / f"{RECORD}.{os.getpid()}.tmp"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(tmp, target)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise DtlabError(describe(e, f"writing '{target}'", str(self.path))) from None


def unrecorded(directory: Path, patterns: Iterable[str], record: dict[str, Any] | None) -> list[str]:
    """Entries of `directory` that match `patterns` (glob patterns of names directly under it)
    and that no record names."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    recorded = set(record["entries"]) if record else set()
    names = sorted(p.name for p in directory.iterdir() if p.name != RECORD)
    return [n for n in names if n not in recorded and
            any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]


def shown(names: list[str], most: int = 4) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def check_own_directory(directory: Path, flag: str) -> None:
    """An output directory is one of its own: not the file system's root nor the home directory,
    whose other files an output there would sit among (and an overwrite would delete)."""
    real = os.path.realpath(directory)
    home = os.path.realpath(os.path.expanduser("~"))
    what = "the file system's root" if real == "/" else "your home directory" if real == home \
        else None
    if what:
        raise NotOurs(f"{flag} '{directory}' is {what}; fix: a directory of its own inside it "
                      "(e.g. runs/NAME)")


def enclosing(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The nearest directory above `directory` that holds a command's output, with its record."""
    for above in Path(os.path.abspath(directory)).parents:
        record = read(above)
        if record is not None:
            return above, record
    return None


def check_not_nested(directory: Path, flag: str, own: Iterable[str] = ()) -> None:
    """A command's output directory is not inside another's (a run's, a compare's, a sweep's):
    that owner may replace or delete what is under it, and its results would count these runs
    as its own. Nor does it hold another output below it (outside `own`, the names of its own
    entries), which its results would count in."""
    found = enclosing(directory)
    if found is not None:
        above, record = found
        raise NotOurs(f"{flag} '{directory}' is inside the output of dtlab {record['kind']} "
                          f"'{above}', which that command may replace or delete and whose results "
                          "would count it in; fix: a directory outside it")
    below = output_below(Path(directory), skip=set(own))
    if below is not None:
        what = "a run" if below[1]["kind"] == "run" else f"the output of dtlab {below[1]['kind']}"
        raise NotOurs(f"{flag} '{directory}' holds {what} in '{below[0]}', which this command's "
                      "results would count in; fix: a directory of its own beside it")


def claim(directory: Path, kind: str, owner: str, writes: Iterable[str], flag: str,
          whose: str = "", elsewhere: str = "choose another directory") -> Owned:
    """The right to write `writes` (glob patterns of names directly under `directory`) there,
    refused with NotOurs before anything is written (see the module's docstring); claiming
    writes nothing. `flag`: how the user named the directory (e.g. "--out"); `whose`: the owner
    as the user knows it (a spec's path), said when another owner's output is in the way;
    `elsewhere`: the fix that writes somewhere else ("" where the command has no such choice)."""
    directory = Path(directory)
    check_own_directory(directory, flag)
    if os.path.lexists(directory) and not directory.is_dir():
        raise NotOurs(f"{flag} '{directory}' is a file, not a directory; fix: move it away"
                      f"{', or ' + elsewhere if elsewhere else ''}")
    record = read(directory)
    if record is not None and (record.get("kind"), record.get("owner")) != (kind, owner):
        theirs = str(record.get("whose") or record.get("owner") or "?")
        if whose and theirs == whose:  # one path, another content: the file was edited since
            theirs, whose = f"{whose} as it was then", f"{whose} as it is now"
        mine = f" ({whose})" if whose else ""
        raise NotOurs(f"{flag} '{directory}' holds the output of dtlab {record['kind']} "
                      f"({theirs}), not of this {kind}{mine}, and writing there would mix the two; "
                      f"fix: {elsewhere + ', or ' if elsewhere else ''}delete that directory first")
    found = unrecorded(directory, writes, record)
    if found:
        them = "it" if len(found) == 1 else "them"
        raise NotOurs(f"{flag} '{directory}' holds {shown(found)}, which dtlab {kind} did not "
                      f"write there and would replace; fix: move {them} away"
                      f"{', or ' + elsewhere if elsewhere else ''}")
    mine = reopened(directory, record) if record else Owned(directory, kind, owner)
    mine.extra.update({"whose": whose} if whose else {})
    return mine


def reopened(directory: Path, record: dict[str, Any]) -> Owned:
    """The Owned that `record` (read() of `directory`) describes: its entries, and what its owner
    noted besides (a run's last checkpoint), kept when it is written again."""
    extra = {k: v for k, v in record.items() if k not in ("kind", "owner", "entries")}
    return Owned(Path(directory), record["kind"], record.get("owner", ""), set(record["entries"]),
                 extra)


def check_made_from(path: Path, flag: str, sources: Iterable[Path]) -> None:
    """A file or directory written inside another command's output (a run's, a compare's, a
    sweep's) is refused unless it is made from that very output (`sources`): a results table,
    report or figures of other runs there would pass for that output's own."""
    found = enclosing(path)
    if found is None or found[1]["kind"] == "plot":
        return
    above, record = found
    keeps = Path(os.path.abspath(above)) / "checkpoints"
    if record["kind"] == "run" and (keeps == Path(os.path.abspath(path)) or
                                    keeps in Path(os.path.abspath(path)).parents):
        parts = Path(path).parts  # the run as the user named it, where the path names it
        run = Path(*parts[:parts.index("checkpoints")]) if "checkpoints" in parts[1:] else above
        raise NotOurs(f"{flag} '{path}' is inside the checkpoints of the run '{run}', which it "
                      "prunes and replaces (and whose files it refuses beside them); fix: a path "
                      f"outside checkpoints/, e.g. -o {run / Path(path).name}")
    if any(os.path.realpath(s) == os.path.realpath(above) for s in sources):
        return
    what = "the run directory" if record["kind"] == "run" else f"the output of dtlab {record['kind']}"
    raise NotOurs(f"{flag} '{path}' is inside {what} '{above}', and what is written there would "
                  "pass for that output's own; fix: a path outside it")


def _outputs_below(directory: Path, depth: int = 3, most: int = 2000,
                   skip: set[str] | frozenset[str] = frozenset()) -> Iterator[tuple[Path, dict]]:
    """The command outputs inside `directory` (not those inside another one), `depth` levels
    down at most and among at most `most` folders, not inside the entries named in `skip` (a
    command's own)."""
    top = Path(directory)
    looked = 0
    for folder, subdirs, names in os.walk(top):
        level = len(Path(folder).relative_to(top).parts)
        if level == 0:
            subdirs[:] = [d for d in subdirs if d not in skip]
        record = read(Path(folder)) if level and RECORD in names else None
        if record is not None:
            yield Path(folder), record
            subdirs.clear()
        looked += len(subdirs)
        if level >= depth or looked > most:
            subdirs.clear()
        subdirs.sort()


def output_below(directory: Path, depth: int = 3, most: int = 2000,
                 skip: set[str] | frozenset[str] = frozenset()) -> tuple[Path, dict] | None:
    """The nearest command output (figures aside) inside `directory` (see _outputs_below)."""
    return next((found for found in _outputs_below(directory, depth, most, skip)
                 if found[1]["kind"] != "plot"), None)


def commands_below(directory: Path, depth: int = 3) -> list[tuple[Path, dict]]:
    """The compare and sweep outputs inside `directory` (see _outputs_below)."""
    return [found for found in _outputs_below(directory, depth)
            if found[1]["kind"] in ("compare", "sweep")]

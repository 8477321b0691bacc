"""Argument types and the parser class of the `dtlab` command line.

Every value is checked where argparse reads it, so that a bad argument ends in one line naming the
option and the fix (exit code 2) before anything starts: no usage block, no traceback.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from dtlab.errors import DtlabError

# The metavars (or, without one, the upper-cased names) of the arguments that name a file or a
# directory: `~` in them is expanded, as a shell expands it at the start of a word only (it leaves
# `--out=~/x`, a quoted '~/x' and a path from a script alone), never a directory named `~`.
PATH_METAVARS = frozenset({"FILE", "DIR", "PATH", "CSV", "HTML", "RESULTS", "RESULTS_CSV",
                           "COMM_CSV", "CHECKPOINT", "RUN_DIR", "RUN_OR_CHECKPOINT", "INPUT",
                           "NAME|FILE", "SPEC"})


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage block stays in --help), option help
    that ends with the default, and `~` expanded in paths (PATH_METAVARS), an empty one refused."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def parse_known_args(self, args: object = None,  # type: ignore[override]
                         namespace: object = None) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)  # type: ignore[arg-type]
        for action in self._actions:
            if (action.metavar or action.dest.upper()) not in PATH_METAVARS:
                continue
            value = getattr(namespace, action.dest, None)
            if value == "" or isinstance(value, list) and "" in value:  # -o '': not "here"
                flag = action.option_strings[0] if action.option_strings else action.dest
                self.error(f"{flag} is empty; fix: name a path, or leave {flag} out for its "
                           "default")
            if isinstance(value, str):
                setattr(namespace, action.dest, os.path.expanduser(value))
            elif isinstance(value, list):
                setattr(namespace, action.dest,
                        [os.path.expanduser(v) if isinstance(v, str) else v for v in value])
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        fix = "" if "fix:" in message else f"; fix: see `{self.prog} --help`"
        self.exit(2, f"dtlab: error: {message}{fix}\n")


class CommandParser(Parser):
    """A command's parser (`dtlab train`, `compare`, ...): options and positionals (KEY=VALUE
    overrides, inputs) in any order, as people type them: `dtlab train model.name=gpt
    --nproc-per-node 2 train.lr=0.1`. Options are read first, then the positionals from what is
    left; an unknown option is still refused by name."""

    _mixing = False  # inside parse_known_intermixed_args, which calls parse_known_args twice

    def parse_known_args(self, args: object = None,  # type: ignore[override]
                         namespace: object = None) -> tuple[argparse.Namespace, list[str]]:
        if self._mixing:
            return super().parse_known_args(args, namespace)  # type: ignore[arg-type]
        self._mixing = True
        try:
            namespace, extras = self.parse_known_intermixed_args(args, namespace)  # type: ignore[arg-type]
        finally:
            self._mixing = False
        unknown = [a for a in extras if a.startswith("-")]
        if unknown:  # named alone (not with the positionals after it), with this command's help
            self.error(f"unrecognized arguments: {' '.join(unknown)}; fix: see "
                       f"`{self.prog} --help`")
        return namespace, extras


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already names its default;
    flags read "(default: off)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return f"{text} (default: off)"
        if action.default in (None, [], ""):
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


def _number(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except (TypeError, ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"'{text}' is not a {'whole ' if kind is int else ''}"
                                         "number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    return value


def integer(minimum: int, example: str, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(_number(text, int))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e}; fix: e.g. {example}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"at least {minimum}" if maximum is None else f"{minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"'{text}' must be {bound}; fix: e.g. {example}")
        return value

    parse.__name__ = "whole number"
    return parse


def number(minimum: float, example: str, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite number >= minimum (> minimum when not inclusive)."""

    def parse(text: str) -> float:
        try:
            value = float(_number(text, float))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e}; fix: e.g. {example}") from None
        if value < minimum or (value == minimum and not inclusive):
            bound = f"at least {minimum:g}" if inclusive else f"above {minimum:g}"
            raise argparse.ArgumentTypeError(f"'{text}' must be {bound}; fix: e.g. {example}")
        return value

    parse.__name__ = "number"
    return parse


def endpoint(text: str) -> str:
    """HOST:PORT of a rendezvous (IPv6 hosts in brackets: [::1]:29400)."""
    host, sep, port = text.rpartition(":")
    fix = "; fix: give HOST:PORT, e.g. --rdzv-endpoint node001:29400"
    if not sep or not host or host in ("[]",) or not port:
        raise argparse.ArgumentTypeError(f"'{text}' is not HOST:PORT{fix}")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"port '{port}' of '{text}' is not 0 to 65535{fix}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise argparse.ArgumentTypeError(f"'{text}': an IPv6 host needs brackets{fix}, "
                                         "or [::1]:29400")
    return text


def key_values(text: str) -> str:
    """k=v,k=v (torch elastic's --rdzv-conf), or nothing."""
    for item in text.split(",") if text else []:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(
                f"'{item}' in '{text}' is not key=value; fix: e.g. is_host=true,join_timeout=600")
    return text


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; fix: give a name, e.g. job42")
    return text


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """`dtlab train`'s launch options (torchrun's)."""
    p.add_argument("--config", metavar="FILE",
                   help="YAML config file (default: the built-in quick config, configs/quick.yaml)")
    p.add_argument("--nproc-per-node", type=integer(1, "--nproc-per-node 2"), default=1,
                   metavar="N", help="worker processes (ranks) on this node, one per GPU; more "
                   "than 1 starts them through torch elastic")
    p.add_argument("--nnodes", type=integer(1, "--nnodes 2"), default=1, metavar="N",
                   help="nodes taking part (multi-node, as torchrun)")
    p.add_argument("--rdzv-endpoint", type=endpoint, metavar="HOST:PORT",
                   help="rendezvous address every node can reach (default: 127.0.0.1 with a "
                   "free port, single node only)")
    p.add_argument("--rdzv-id", type=nonempty, default="dtlab", metavar="ID",
                   help="job id shared by all nodes of one run")
    p.add_argument("--max-restarts", type=integer(0, "--max-restarts 3"), default=0,
                   metavar="N", help="restarts of the worker group after a failure; each "
                   "restart resumes from the latest checkpoint")
    p.add_argument("--rdzv-conf", type=key_values, default="", metavar="K=V,...",
                   help="extra rendezvous settings, e.g. is_host=true on the node that hosts "
                   "the c10d store (default: none)")


# ------------------------------------------------------------------------------ files and dirs
def input_file(flag: str, path: str | Path, fix: str) -> Path:
    """A file that will be read: exists, is a file, readable. `fix` says how to make it."""
    p = Path(path)
    if p.is_dir():
        raise DtlabError(f"{flag} '{p}' is a directory, not a file; fix: {fix}")
    if not p.is_file():
        raise DtlabError(f"{flag} '{p}' not found; fix: {fix}")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise DtlabError(f"{flag} '{p}' cannot be read ({e.strerror}); fix: check its "
                         "permissions (chmod u+r)") from None
    return p


def input_dir(flag: str, path: str | Path, fix: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise DtlabError(f"{flag} '{p}' not found; fix: {fix}")
    if not p.is_dir():
        raise DtlabError(f"{flag} '{p}' is not a directory; fix: {fix}")
    return p


def output_file(flag: str, path: str | Path, example: str = "out") -> Path:
    """A file that will be written: not a directory, and its parent is (or can be) a directory."""
    p = Path(path)
    if str(path) == "-":  # not standard output: a file of that name would be written
        raise DtlabError(f"{flag} '-': dtlab writes a file, not standard output; fix: name the "
                         f"file, e.g. {flag.split('/')[-1]} {example}")
    if p.is_dir():
        raise DtlabError(f"{flag} '{p}' is a directory; fix: name a file in it, e.g. "
                         f"{flag.split('/')[-1]} {p / example}")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise DtlabError(f"{flag} '{p}': '{parent}' is a file, not a directory; fix: choose "
                             "another path")
    return p


def output_dir(flag: str, path: str | Path) -> Path:
    """A directory that will be written (created when missing)."""
    p = Path(path)
    for d in (p, *p.parents):
        if d.exists() and not d.is_dir():
            raise DtlabError(f"{flag} '{p}': '{d}' is a file, not a directory; fix: choose "
                             "another directory")
    return p


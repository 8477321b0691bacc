"""The set-up the suite runs in, and the documents generated from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="not running in a virtual environment")
def test_the_venv_sees_only_what_pyproject_declares() -> None:
    """`make venv` builds a hermetic venv: the machine's own site-packages are not on sys.path."""
    outside = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")
               and not Path(p).resolve().is_relative_to(Path(sys.prefix).resolve())]
    assert not outside, f"packages from outside the venv are importable: {outside}"


def test_the_reliability_case_table_is_generated_from_the_tests() -> None:
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "reliability_cases.py", "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_xdist_keeps_each_group_on_one_worker(request: pytest.FixtureRequest) -> None:
    """`make test` (--dist loadgroup) sends each group of tests/conftest.py to one worker: its
    module and session fixtures (a compare, a sweep, the SLURM cluster) run once. xdist tags a
    grouped test's id with its group; an incompatible pytest leaves it untagged and every group
    is spread over the workers, doubling the suite's most expensive set-ups."""
    if not getattr(request.config.option, "loadgroup", False):  # what xdist sets on a worker
        pytest.skip("not running under --dist loadgroup")
    assert request.node.nodeid.endswith("@test_setup"), request.node.nodeid

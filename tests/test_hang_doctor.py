"""`dtlab doctor hang` on dumps written here by hand: the verdicts a real hang does not produce
(ranks that disagree, a rank that left no dump, NCCL's pickled dumps) and the refusal of a pickle
that would run code. A real hang's dumps and verdict: tests/test_reliability.py and guide 08."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from conftest import dtlab

from dtlab.doctor.hang import read_dumps, report
from dtlab.errors import DtlabError

GROUP = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}


def entry(seq: int, op: str = "all_reduce", size: int = 1000) -> dict:
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ["0", "default_pg"],
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": f"nccl:{op}", "time_created_ns": 0, "input_sizes": [[size]],
            "input_dtypes": ["Float"], "output_sizes": [[size]], "output_dtypes": ["Float"],
            "state": "scheduled", "retired": True, "timeout_ms": 5000, "is_p2p": False,
            "frames": []}


def dump(entries: list[dict]) -> dict:
    return {"version": "2.10", "pg_config": GROUP, "pg_status": {}, "entries": entries}


def write_json(run: Path, rank: int, entries: list[dict], reason: str = "stopped") -> None:
    (run / "flight_recorder").mkdir(parents=True, exist_ok=True)
    data = dump(entries) | {"dtlab": {"rank": rank, "world_size": 3, "reason": reason,
                                      "time": "2026-11-23T12:00:00+00:00"}}
    (run / "flight_recorder" / f"rank{rank}.json").write_text(json.dumps(data))


def test_ranks_that_disagree_and_a_rank_without_a_dump(tmp_path: Path) -> None:
    write_json(tmp_path, 0, [entry(1), entry(2, "all_gather", 500)])
    write_json(tmp_path, 1, [entry(1), entry(2, "all_reduce", 500)])
    text = report(tmp_path)
    assert "flight recorder of" in text and "2 of 3 rank(s) dumped" in text
    assert ("all ranks entered #2, but not the same collective: the ranks disagree "
            "(nccl:all_gather, input [[500]] Float (2,000 bytes) | nccl:all_reduce, input [[500]] "
            "Float (2,000 bytes))") in text
    assert "rank(s) [2] left no dump" in text


def test_nccl_watchdog_dumps_are_read_as_plain_data(tmp_path: Path) -> None:
    folder = tmp_path / "flight_recorder"
    folder.mkdir()
    for rank, last in ((0, 7), (1, 7), (2, 6)):  # rank 2 never entered #7
        (folder / f"nccl_rank{rank}").write_bytes(
            pickle.dumps(dump([entry(s) for s in range(1, last + 1)])))
    assert sorted(read_dumps(tmp_path)) == [0, 1, 2]
    proc = dtlab("doctor", "hang", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 (written by NCCL's watchdog)" in proc.stdout
    assert ("verdict: rank(s) [2] never entered collective #7 (nccl:all_reduce, input [[1000]] "
            "Float (4,000 bytes)); rank(s) [0, 1] entered it and waited for them") in proc.stdout


class Payload:
    """What a malicious dump would hold: unpickling it calls Path.touch."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.target,))


def test_a_dump_that_would_run_code_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "flight_recorder"
    folder.mkdir()
    touched = tmp_path / "ran"
    (folder / "nccl_rank0").write_bytes(pickle.dumps(dump([entry(1)]) | {"x": Payload(touched)}))
    with pytest.raises(DtlabError, match=r"cannot read the flight-recorder dump '.*nccl_rank0' "
                                         r"\(refusing pathlib.Path.touch: a dump holds plain data "
                                         r"only\); fix: move it out of the folder"):
        read_dumps(tmp_path)
    assert not touched.exists()


def test_a_directory_without_dumps_is_one_line(tmp_path: Path) -> None:
    proc = dtlab("doctor", "hang", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        f"dtlab: error: no flight-recorder dumps in '{tmp_path / 'flight_recorder'}'; they are "
        "written when a distributed run fails or is stopped; fix: pass the run directory "
        "(run.dir) of such a run, with run.flight_recorder > 0")


def test_the_group_layout_skips_groups_this_rank_is_not_in() -> None:
    """torch.distributed keeps a marker for a group a rank is not a member of (pipeline
    parallelism's per-stage groups): the dump describes only real groups."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtlab.instruments.flight_recorder import group_config

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dist.new_group([1])
        assert group_config() == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    finally:
        dist.destroy_process_group()


def test_no_rank_behind_says_where_else_to_look(tmp_path: Path) -> None:
    """Pipeline parallelism on gloo: the timed-out send is not in the recorder."""
    for rank in (0, 1, 2):
        write_json(tmp_path, rank, [entry(1), entry(2)])
    text = report(tmp_path)
    assert "all ranks entered #2: none is behind in this group" in text
    assert ("no rank is behind in the recorded collectives: the wait was in an operation the "
            "recorder does not keep (gloo records no point-to-point send or receive") in text

"""What a second new-user audit (issue 26) found in prepare, sample and comm after the issue's
fixes: each case is refused in one line naming the input and the fix, exit 2, no traceback, and
the workspace is byte-for-byte as before (no output directory made, no user file replaced).

CASES: (what the case shows, as a sentence; the command line after `dtlab`, `{ws}` the
workspace; text the one line on stderr must contain). All run in this process (conftest's
`dtlab()`): every refusal comes before a rank or a worker starts.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import cli, dtlab
from test_bad_inputs import refused

GPT = "model.name=gpt model.n_layer=1 model.n_embd=16 model.n_head=2 model.block_size=16"
COMM = "comm --max-bytes 64 --iters 1"
FINISHED = "train.max_steps=4 train.checkpoint_every=2 run.progress=false"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ws = tmp_path_factory.mktemp("bad_inputs_audit2")
    (ws / "null_text.jsonl").write_text('{"text": "a line"}\n{"text": null}\n')
    (ws / "number_text.jsonl").write_text('{"text": 5}\n')
    (ws / "notes.txt").write_text("a user's notes\n")
    no_meta_run(ws / "no_meta_run", ws / "moved_tokens")
    (ws / "file_run").mkdir()
    (ws / "file_run" / "checkpoints").write_text("a user's notes\n")
    done = dtlab("train", *FINISHED.split(), f"run.dir={ws}/finished")
    assert done.returncode == 0, done.stderr
    return ws


def no_meta_run(run: Path, data_dir: Path) -> None:
    """A GPT run trained on prepared tokens (config.yaml + model.safetensors) whose data
    directory, and with it the meta.json naming the tokenizer, has since gone."""
    from safetensors.torch import save_file

    from dtlab.config import load_config, to_yaml
    from dtlab.data import spec_for
    from dtlab.models import build_model

    cfg = load_config(None, [*GPT.split(), "data.name=tokens", f"data.dir={data_dir}"])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    save_file(build_model(cfg.model, spec_for(cfg)).state_dict(), str(run / "model.safetensors"))


CASES = [
    ("prepare refuses a .jsonl line whose text is null instead of tokenizing 'None'",
     "prepare {ws}/null_text.jsonl --out {ws}/tokens",
     "null_text.jsonl:2 is not a JSON object with a 'text' string; fix: repair the line"),
    ("prepare refuses a .jsonl line whose text is a number",
     "prepare {ws}/number_text.jsonl --out {ws}/tokens",
     "number_text.jsonl:1 is not a JSON object with a 'text' string"),
    ("sample refuses a seed the generator cannot take instead of overflowing",
     "sample {ws}/no_meta_run --seed 100000000000000000000000",
     "argument --seed: '100000000000000000000000' must be 0 to 9223372036854775807"),
    ("sample says a run's token data is gone instead of calling it synthetic tokens",
     "sample {ws}/no_meta_run --prompt hello",
     "moved_tokens', whose meta.json (naming its tokenizer) is missing or unreadable; fix: put "
     "the data set back there"),
    ("comm refuses a timeout too short for its ranks to meet instead of a traceback per rank",
     f"{COMM} --timeout 0.001", "--timeout 0.001 is shorter than the ranks take to meet"),
    ("comm refuses a size factor that makes millions of message sizes",
     f"{COMM} --factor 1.000001 --max-bytes 32M",
     "--factor 1 from 8 to 33554432 bytes makes more than 1000 message sizes"),
    ("comm names --device cuda, once, on a machine without CUDA",
     f"{COMM} --device cuda", "--device cuda needs a CUDA device, and none is visible; fix: "
     "--device cpu"),
    ("comm names --backend nccl, once, on a machine without CUDA",
     f"{COMM} --backend nccl", "--backend nccl needs a CUDA device"),
    ("comm refuses --json and --csv naming one file", f"{COMM} --json {{ws}}/r --csv {{ws}}/r",
     "--json and --csv name the same file"),
    ("comm refuses to write its --json over a user's file",
     f"{COMM} --json {{ws}}/notes.txt", "--json '{ws}/notes.txt' exists and is not an earlier "
     "dtlab comm --json file: writing there would replace it; fix: give --json another file name"),
    ("comm refuses to write its --csv over a user's file",
     f"{COMM} --csv {{ws}}/notes.txt", "--csv '{ws}/notes.txt' exists and is not an earlier"),
    ("comm refuses a message size whose buffers cannot fit in host memory",
     "comm --max-bytes 1024G --iters 1", "needs about 6144.0 GiB of host memory on 2 ranks"),
    ("train refuses a run.dir holding a user's file where its checkpoints go",
     "train train.max_steps=2 run.dir={ws}/file_run",
     "holds 'checkpoints', which is not a directory"),
    ("resuming a run past the new train.max_steps is refused instead of a summary of no step",
     "train train.max_steps=2 train.checkpoint_every=2 run.progress=false run.dir={ws}/finished",
     "is at step 4, past this run's last step 2; fix: train.max_steps=4 or more"),
    ("compare refuses a resume override it would silently replace",
     "compare --strategies single --out {ws}/cmp resume=auto",
     "resume and run.overwrite are chosen by compare"),
]


@pytest.mark.parametrize("case,command,message", CASES, ids=[c[0] for c in CASES])
def test_refused_in_one_line(workspace: Path, case: str, command: str, message: str) -> None:
    """Each audit case: exit 2, one `dtlab: error:` line naming the input and the fix, no
    traceback, nothing written."""
    error = refused(shlex.split(command.format(ws=workspace)), workspace)
    assert message.format(ws=workspace) in error, error


POOL_STOP = """
import os, signal, sys, time
from dtlab.text import prepare
pool = prepare._start_pool(2, "bytes")
pids = [p.pid for p in pool._pool]
ignored = [int(open(f"/proc/{pid}/status").read().split("SigIgn:")[1].split()[0], 16)
           >> (signal.SIGINT - 1) & 1 for pid in pids]
results = pool.imap(prepare._encode_in_worker, [["x" * (64 << 20)]] * 2)
time.sleep(0.3)  # a 64 MB chunk is on its way to a worker
for pid in pids:
    os.kill(pid, signal.SIGKILL)  # as a group SIGTERM kills them
started = time.monotonic()
prepare._stop_pool(pool)
print("ignored", sum(ignored), "stopped", time.monotonic() - started < 10)
"""


def test_prepare_workers_leave_ctrl_c_to_prepare_and_cannot_hang_its_stop() -> None:
    """Prepare's encoding workers ignore Ctrl-C (the whole process group gets it; a worker dying
    of it printed a traceback), and stopping them returns although a signal killed them while a
    chunk was being sent (Pool.terminate waited for that chunk for ever)."""
    proc = subprocess.run([sys.executable, "-c", POOL_STOP], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ignored 2 stopped True" in proc.stdout, proc.stdout + proc.stderr


def test_comm_measures_each_message_once() -> None:
    """Sizes that round to the same number of elements are one row, not one row per byte
    (--factor 1.1 from 8 to 16 bytes measures 2, 3 and 4 floats)."""
    started = time.monotonic()
    proc = cli("comm", "--nproc-per-node", "1", "--min-bytes", "8", "--max-bytes", "16",
               "--factor", "1.1", "--iters", "1", "--warmup", "0", "--device", "cpu", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = [line.split()[1] for line in proc.stdout.splitlines() if " float " in line]
    assert counts == ["2", "3", "4"], proc.stdout
    assert time.monotonic() - started < 60


def test_resume_drops_damaged_lines_of_metrics_jsonl(tmp_path: Path) -> None:
    """A resume over a metrics.jsonl with bytes that are not UTF-8 and lines that are not records
    (a disk or a hand damaged it) keeps its good records and drops the rest, as it drops a line
    torn by a crash (it was a UnicodeDecodeError traceback)."""
    run = tmp_path / "run"
    tiny = [*GPT.split(), "train.global_batch_size=4", "run.progress=false", "run.log_every=1",
            f"run.dir={run}"]
    assert dtlab("train", *tiny, "train.max_steps=2", "train.checkpoint_every=2").returncode == 0
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"\xab\xff not utf-8\n5\n[1]\n{\"step\": \"x\", \"loss\": 1}\n")
    proc = dtlab("train", *tiny, "train.max_steps=3", "train.checkpoint_every=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "resuming from" in proc.stderr + proc.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]

"""Stops, waits, validation and collection tell the truth:

- Ctrl-C at any moment of a command (while it imports, repeated while it exits) is one line and
  exit code 130, as a user runs it: the `dtlab` console script, in a session of its own;
- a multi-node rendezvous waiting for absent nodes says so within seconds, naming its timeout,
  and gives up in one line;
- `dtlab predict --validate` refuses another machine's cluster and a validation of nothing;
- `dtlab collect` reads an interrupted run's strategy and world size from what it left;
- `~` in every path setting and path argument is the home directory, never a directory `~`.

The real processes are few and short: each stopped while it starts, or while it waits."""

from __future__ import annotations

import csv
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import pytest
from conftest import CONFIGS, dtlab, free_port

from dtlab.config import load_config, to_yaml
from dtlab.process.interrupt import descendant_groups, live_groups

SCRIPT = Path(sys.executable).with_name("dtlab")  # the console script pip installed
COMMAND = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-m", "dtlab"]
QUICK = ["--config", str(CONFIGS / "quick.yaml"), "run.progress=false"]


def start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([*COMMAND, *args], cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def signal_group(proc: subprocess.Popen[str], sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):  # already gone: nothing more to stop
        os.killpg(proc.pid, sig)


def lines_of(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def assert_one_line(code: int, stdout: str, stderr: str, sig: signal.Signals) -> None:
    output = stdout + stderr
    assert code == 128 + sig, f"exit {code}\n{output[-3000:]}"
    assert "Traceback" not in output and "Exception" not in output, output[-3000:]
    lines = lines_of(stderr)
    assert len(lines) == 1 and lines[0].startswith(f"dtlab: interrupted by {sig.name}"), lines


# ------------------------------------------------------------------------------ 1. Ctrl-C
def when_loaded(proc: subprocess.Popen[str], library: str, timeout: float = 120) -> None:
    """Return once the process has mapped `library`, a shared object one of its imports loads:
    a moment of its start that no clock on a busy machine would hit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with suppress(OSError):
            if library in Path(f"/proc/{proc.pid}/maps").read_text():
                return
        time.sleep(0.005)
    raise AssertionError(f"{library} was not loaded: {proc.communicate()[1][-3000:]}")


def test_ctrl_c_while_a_command_starts_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C (once, or three times in 0.1 s) while `dtlab train` starts: as the command line
    imports its modules (pydantic, the config schema; where the console script printed a
    KeyboardInterrupt traceback) and as it imports torch."""
    for library in ("_pydantic_core", "libtorch_cpu"):
        for times in (1, 3):
            proc = start(["train", *QUICK, f"run.dir={tmp_path / 'run'}"], tmp_path)
            when_loaded(proc, library)
            for _ in range(times):
                signal_group(proc, signal.SIGINT)
                time.sleep(0.05)
            out, err = proc.communicate(timeout=120)
            assert_one_line(proc.returncode, out, err, signal.SIGINT)


def test_ctrl_c_again_while_a_stopped_command_exits_is_not_another_line(tmp_path: Path) -> None:
    """Ctrl-C, then twice more as soon as its line is out, while the process tears down (torch
    loaded): no "Exception ignored in atexit callback", no traceback, still exit 130."""
    proc = start(["train", *QUICK, f"run.dir={tmp_path / 'run'}"], tmp_path)
    when_loaded(proc, "libtorch_cpu")
    time.sleep(0.3)
    signal_group(proc, signal.SIGINT)
    assert proc.stderr is not None
    first = proc.stderr.readline()
    for _ in range(2):
        signal_group(proc, signal.SIGINT)
        time.sleep(0.05)
    out, err = proc.communicate(timeout=120)
    assert_one_line(proc.returncode, out, first + err, signal.SIGINT)


class Dropping:
    """Ctrl-C while Python runs a __del__ (or a weakref callback, or C code that clears errors):
    the handler's Interrupted is raised there and dropped. Seen in 2 of 40 Ctrl-Cs during a
    run's set-up, which then trained to its end, deaf to more Ctrl-Cs."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


def test_a_stop_dropped_where_python_drops_errors_still_stops(capfd: pytest.CaptureFixture[str]
                                                              ) -> None:
    """The dropped stop is not forgotten: a nested scope (the 1-rank run inside `dtlab train`)
    keeps it, the training loop raises it before its first step, nothing is printed for it."""
    from dtlab.process.interrupt import Interrupted, deferred, handling, lost

    with handling():
        Dropping()
        with handling():
            assert lost() is not None
            with pytest.raises(Interrupted), deferred(5.0):
                pytest.fail("the loop ran")
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_command_that_goes_on_after_a_dropped_stop_ends_with_its_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A command that finished (exit 0) after its stop was dropped: exit 130 and the one line."""
    from dtlab.cli import main as cli

    def config_after_a_dropped_stop(args: object) -> int:
        Dropping()
        return 0

    monkeypatch.setattr(cli, "cmd_config", config_after_a_dropped_stop)
    proc = dtlab("config")
    assert (proc.returncode, lines_of(proc.stderr)) == (130, ["dtlab: interrupted by SIGINT"])


# ------------------------------------------------------------------------------ 2. rendezvous
def waiting_pattern(port: int, timeout: str) -> re.Pattern[str]:
    endpoint = re.escape(f"127.0.0.1:{port}")
    return re.compile(rf"dtlab: waiting for 1 of 2 nodes at {endpoint} \(\d+ s so far, "
                      rf"rendezvous timeout: {timeout} s\); start `dtlab train --nnodes 2 "
                      rf"--rdzv-endpoint {endpoint}` with the same config on each of them")


def test_a_rendezvous_waiting_for_an_absent_node_says_so_and_stops_in_one_line(
        tmp_path: Path) -> None:
    """`dtlab train --nnodes 2` without the other node: within seconds a line says how many
    nodes are missing where and when the rendezvous gives up (torch elastic says nothing for
    600 s); SIGTERM then stops it with one more line, exit 143, nothing left running."""
    port = free_port()
    proc = start(["train", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
                  f"127.0.0.1:{port}", *QUICK, "strategy.name=ddp",
                  f"run.dir={tmp_path / 'run'}"], tmp_path)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        first = lines.get(timeout=40)  # 3 s after the launcher starts; torch's import first
    finally:
        groups = {proc.pid} | descendant_groups(proc.pid)
        signal_group(proc, signal.SIGTERM)
        proc.wait(timeout=60)
    assert time.monotonic() - started < 40
    assert waiting_pattern(port, "600").fullmatch(first.strip()), first
    reader.join(timeout=10)
    rest = lines_of("".join(lines.queue))
    assert proc.returncode == 143, rest
    assert rest == ["dtlab: interrupted by SIGTERM before the workers started"], rest
    assert live_groups(groups) == [], "processes of the run are left"


def test_a_rendezvous_that_times_out_says_so_in_one_line(tmp_path: Path) -> None:
    """The rendezvous gives up (--rdzv-conf join_timeout=4): its waiting line, then one line
    naming the endpoint and the fix, exit 1; no RendezvousTimeoutError traceback."""
    port = free_port()
    proc = dtlab("train", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
                 f"127.0.0.1:{port}", "--rdzv-conf", "join_timeout=4", *QUICK, "strategy.name=ddp",
                 f"run.dir={tmp_path / 'run'}")
    lines = lines_of(proc.stderr)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert len(lines) == 2 and waiting_pattern(port, "4").fullmatch(lines[0]), lines
    assert lines[1] == (f"dtlab: error: the rendezvous at 127.0.0.1:{port} gave up: not all 2 "
                        "nodes joined within its timeout; fix: start `dtlab train --nnodes 2 "
                        f"--rdzv-endpoint 127.0.0.1:{port}` on every node, or give them longer "
                        "with --rdzv-conf join_timeout=SECONDS")


# ------------------------------------------------------------------------------ 3. validate
def refused(*args: str, code: int = 2) -> str:
    proc = dtlab(*args)
    lines = lines_of(proc.stderr)
    assert proc.returncode == code and len(lines) == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout, proc.stdout + proc.stderr
    return lines[0]


def test_validate_refuses_a_cluster_that_is_not_this_machine() -> None:
    """--validate on this CPU (the suite hides GPUs) with an H100 cluster: refused before
    anything is measured, naming this machine's cluster (the audit saw a "-92.2%" error)."""
    assert refused("predict", "--validate", "--cluster", "h100_sxm_8x") == (
        "dtlab: error: --validate runs the strategies here, on this machine's CPU, and "
        "--cluster h100_sxm_8x describes NVIDIA H100 SXM5 80GB: its prediction beside these "
        "runs would measure the machines' difference; fix: --cluster cpu_gloo (this machine), "
        "or drop --validate to predict h100_sxm_8x")


def test_validate_matches_a_gpu_cluster_by_its_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """What --validate takes for this machine's on a GPU: the GPU model the cluster names
    (the runs' device and the GPU's name as torch reports them on an H200, here faked)."""
    import torch

    import dtlab.config.device
    from dtlab.errors import ConfigError
    from dtlab.predict.validate import describes, local_cluster

    monkeypatch.setattr(dtlab.config.device, "device_type", lambda cfg: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    assert local_cluster("h200_sxm_8x", None, []).name == "h200_sxm_8x"
    for name, given in (("h100_sxm_8x", "--cluster h100_sxm_8x describes NVIDIA H100 SXM5 80GB"),
                        (None, "the default cluster cpu_gloo describes a CPU")):
        with pytest.raises(ConfigError) as refusal:
            local_cluster(name, None, [])
        assert str(refusal.value).startswith(f"--validate runs the strategies here, on NVIDIA "
                                             f"H200, and {given}: "), refusal.value
        assert "fix: --cluster h200_sxm_8x (this machine)" in str(refusal.value)

    assert describes("cpu", "cpu")
    assert describes("NVIDIA H100 SXM5 80GB", "NVIDIA H100 80GB HBM3")
    assert describes("NVIDIA A100 SXM4 80GB", "NVIDIA A100-SXM4-80GB")
    assert not describes("NVIDIA H100 SXM5 80GB", "NVIDIA H200")
    assert not describes("NVIDIA H200 SXM 141GB", "cpu")
    assert not describes("cpu", "NVIDIA H100 80GB HBM3")
    assert describes("RTX workstation", "NVIDIA GeForce RTX 4090")  # no model named: any GPU


def test_validate_that_would_run_nothing_is_refused() -> None:
    """A batch of 63 on 2 ranks: every strategy is refused, so nothing would be validated (it
    printed skips and exited 0). (2 ranks: allowed on 1 core or more, which a test worker has.)"""
    assert refused("predict", "--validate", "--world-size", "2", "train.global_batch_size=63") == (
        "dtlab: error: --validate has nothing to run: ddp on 2 ranks is refused (and so are fsdp "
        "on 2, zero1 on 2): --strategies 'ddp' on --world-size 2: train.global_batch_size=63 "
        "must be a positive multiple of world_size(2) x train.grad_accum_steps(1) = 2; fix: set "
        "train.global_batch_size to a multiple of 2")


# ------------------------------------------------------------------------------ 4. collect
def stopped_run(run: Path, *overrides: str, world: int | None = None,
                checkpoint_world: int | None = None) -> None:
    """The files a `dtlab train` stopped by Ctrl-C leaves (no summary.json): config.yaml, its
    run.json, metrics and progress; the ranks' flight-recorder dumps (`world` ranks), and a
    checkpoint's manifest when it saved one."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(load_config(None, list(overrides))))
    (run / "run.json").write_text(json.dumps({
        "status": "interrupted", "returncode": 130, "finished_at": "2026-12-01T10:00:00+00:00",
        "reason": "interrupted by SIGINT at step 11; no checkpoint (train.checkpoint_every=0), "
                  "a rerun starts over"}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 2.3}) + "\n")
    (run / "progress").write_text(f"{11:>12d}\n")
    if checkpoint_world:
        step = run / "checkpoints" / "step_000010"
        step.mkdir(parents=True)
        (step / "dtlab-checkpoint.json").write_text(json.dumps(
            {"format": "dtlab-checkpoint/1", "step": 10, "world_size": checkpoint_world}))
        os.utime(step / "dtlab-checkpoint.json", (1e9, 1e9))  # older than the dumps
    for rank in range(world or 0):
        dump = run / "flight_recorder" / f"rank{rank}.json"
        dump.parent.mkdir(exist_ok=True)
        dump.write_text(json.dumps({"entries": [], "dtlab": {
            "rank": rank, "world_size": world, "reason": "SIGINT", "time": "2026-12-01"}}))


def test_collect_reads_an_interrupted_runs_strategy_and_world_size(tmp_path: Path) -> None:
    """Interrupted runs (run.json, no summary.json) were listed as world_size 1 and no
    strategy: now the strategy comes from config.yaml and the world size from the newer of the
    last checkpoint and the ranks' dumps; where nothing says it, it is left blank."""
    root = tmp_path / "runs"
    stopped_run(root / "ddp2", "strategy.name=ddp", world=2)
    stopped_run(root / "fsdp1_4", "strategy.name=fsdp1",
                "strategy.fsdp1.sharding_strategy=SHARD_GRAD_OP", checkpoint_world=4)
    stopped_run(root / "resumed", "strategy.name=fsdp", world=2, checkpoint_world=4)
    stopped_run(root / "single", "strategy.name=single")
    stopped_run(root / "unknown", "strategy.name=zero1")
    out = tmp_path / "results.csv"
    proc = dtlab("collect", str(root), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    with open(out, newline="") as f:
        rows = {r["source"]: (r["strategy"], r["world_size"], r["status"])
                for r in csv.DictReader(f)}
    assert rows == {"ddp2": ("ddp", "2", "interrupted"),
                    "fsdp1_4": ("fsdp1:SHARD_GRAD_OP", "4", "interrupted"),
                    "resumed": ("fsdp", "2", "interrupted"),
                    "single": ("single", "1", "interrupted"),
                    "unknown": ("zero1", "", "interrupted")}, rows


# ------------------------------------------------------------------------------ 5. ~
def test_tilde_in_path_settings_and_arguments_is_the_home_directory(tmp_path: Path) -> None:
    """`run.dir=~/x` (a shell leaves ~ inside a word alone) made a directory `./~`: every path
    setting, from an override or a YAML file, and every path argument, `--opt=~/x` too, is
    read as the home directory."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / "c.yaml").write_text("run: {dir: ~/from_yaml}\ndata: {dir: ~/data}\n")
    env = {"HOME": str(home)}
    proc = dtlab("config", "--config=~/c.yaml", "resume=~/ck", "model.name=hf",
                 "model.hf.path=~/llama", "strategy.deepspeed.config=~/ds.json", cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    cfg = proc.stdout
    for key, path in (("dir", "from_yaml"), ("dir", "data"), ("resume", "ck"), ("path", "llama"),
                      ("config", "ds.json")):
        assert f"{key}: {home / path}\n" in cfg, (key, path, cfg)
    proc = dtlab("train", *QUICK, "run.dir=~/x", "train.max_steps=1", cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (home / "x" / "summary.json").is_file()
    proc = dtlab("collect", "~/x", "--output=~/results.csv", cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"1 runs -> {home / 'results.csv'}"
    assert not (cwd / "~").exists()

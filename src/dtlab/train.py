"""The training loop: one loop for every strategy.

    torchrun --nproc_per_node=N -m dtlab.train --config FILE [key=value ...]
    deepspeed --num_gpus N --module dtlab.train [key=value ...]   (strategy.name=deepspeed)

Read `train()` top to bottom: data, model, strategy, optimizer, resume, then for each step: the
step (dtlab/run/step.py), log, evaluate, checkpoint; then the summary.
"""

from __future__ import annotations

# ruff: noqa: E402 - a worker's signal handling starts before its imports (torch takes seconds)
if __name__ == "__main__":
    from dtlab.process.early_exit import exit_on_signals

    exit_on_signals()

import argparse
import contextlib
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from dtlab import files, strategies
from dtlab.config import (
    Config,
    check_environment,
    check_world,
    load_config,
    to_yaml,
)
from dtlab.config.limits import MAX_INT
from dtlab.config.strategies import registry
from dtlab.data import EvalLoader, SampleUsage, TrainLoader, build_datasets, check_data_dir
from dtlab.distributed import (
    DistContext,
    detect_env,
    distributed,
    is_comm_failure,
    leave,
    who_stopped,
)
from dtlab.errors import ConfigError, DtlabError, PeerError, RunError
from dtlab.instruments import flight_recorder
from dtlab.instruments.memory_snapshot import out_of_memory
from dtlab.instruments.metrics import MetricsLog, log_step, restart_peak
from dtlab.instruments.profile_window import windows
from dtlab.instruments.trackers import open_trackers
from dtlab.levers import activation_checkpoint, lora, numerics
from dtlab.levers.compile import compile_blocks, compiled_forward
from dtlab.levers.optim import build_scheduler
from dtlab.models import build_model, check_model, check_model_size, count_params, memory_format
from dtlab.process import interrupt
from dtlab.process.interrupt import Interrupted
from dtlab.run import checkpoint, dir_lock, state
from dtlab.run import owner as run_owner
from dtlab.run.dir_watch import DirectoryWatch, PeerSawRunDirGone, RunDirGone, check_directory
from dtlab.run.faults import Fault, check_fault
from dtlab.run.run_state import RunState, Training
from dtlab.run.step import Stepper
from dtlab.run.stop import (
    STOP_DEADLINE_S,
    StopVote,
    last_checkpoint,
    record_stop,
    resume_hint,
    stop_at_boundary,
)
from dtlab.run.summary import comm_breakdown, save_model, summarize


def build(cfg: Config, ctx: DistContext) -> tuple[Training, Any, TrainLoader, EvalLoader]:
    """Data, model, strategy, optimizer, schedule and step, as every strategy builds them."""
    t = cfg.train
    micro = check_world(cfg, ctx.world_size, ctx.env.local_world_size)
    train_set, val_set, spec = build_datasets(cfg, ctx)
    # Identical initial weights on every rank, for every strategy (unless the lab switch breaks it).
    torch.manual_seed(cfg.seed + (ctx.rank if cfg.lab.per_rank_init_seed else 0))
    model = build_model(cfg.model, spec, t.lora)
    n_params = count_params(model)
    strategy = strategies.build(cfg, ctx)
    # before wrapping, in this order: the layout, checkpointing, then compiling what it made
    memory_format.apply(model, cfg.model, ctx.device, weights=not strategy.contiguous_params)
    activation_checkpoint.apply(model, t.activation_checkpointing, t.ac_every)
    compile_blocks(model, t.compile, t.compile_backend)
    model, optimizer = strategy.setup(model)  # the optimizer over the shards this rank owns
    forward = compiled_forward(model, t.compile, t.compile_backend)

    # Batches are dealt to data-parallel replicas (all ranks of one replica see the same samples);
    # without a distributed sampler every rank draws the whole data set's batches itself.
    dp_rank, dp_size = (0, 1) if cfg.lab.no_distributed_sampler else (strategy.dp_rank, strategy.dp_size)
    loader = TrainLoader(train_set, dp_rank, dp_size, micro, t.grad_accum_steps, cfg.seed)
    val_loader = EvalLoader(val_set, strategy.dp_rank, strategy.dp_size,
                            cfg.data.val_batch_size or micro, pad=not cfg.lab.uneven_eval)
    scheduler = build_scheduler(optimizer, t, total_steps(cfg, loader))
    engine = strategy.step_engine(model, forward, optimizer)
    stepper = Stepper(cfg, engine, scheduler, Fault(cfg.run.fault, ctx.rank))
    training = Training(strategy, model, forward, optimizer, scheduler, engine, stepper, spec,
                        n_params, micro)
    return training, train_set, loader, val_loader


def check_paths(cfg: Config, config: str | None = None) -> None:
    """Before any rank starts: the model's source and data.dir can be read, the run directory can
    be written and holds no other run to mix this one with (`config`: the --config file)."""
    check_model(cfg.model)
    check_model_size(cfg)
    if cfg.train.lora.rank:
        lora.require_peft()
    check_data_dir(cfg)
    files.check_writable_dir(cfg.run.run_dir, "run.dir")
    run_owner.check_start(cfg, config)


def total_steps(cfg: Config, loader: TrainLoader) -> int:
    steps = cfg.train.max_steps or cfg.train.epochs * loader.steps_per_epoch
    if steps > MAX_INT:  # each bound alone, the config's check; their product, known here
        raise ConfigError(f"train.epochs={cfg.train.epochs} of {loader.steps_per_epoch:,} steps "
                          f"are {steps:,} steps, past what a run can use (at most 2**53); fix: "
                          "fewer train.epochs, or train.max_steps")
    return steps


def train(cfg: Config, ctx: DistContext) -> dict[str, Any]:
    run_dir = cfg.run.run_dir
    watch = DirectoryWatch(run_dir)  # what is written after a failure goes only where it belongs
    fresh = not run_dir.exists()
    try:
        return _train_and_record(cfg, ctx, run_dir, watch)
    except BaseException:
        if ctx.is_main and fresh and watch.intact():  # failed in set-up: no empty run.dir left
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise


def _train_and_record(cfg: Config, ctx: DistContext, run_dir: Path,
                      watch: DirectoryWatch) -> dict[str, Any]:
    try:
        summary = _train(cfg, ctx, run_dir, watch)
    except Interrupted as e:
        e.where = e.where or f" during set-up{last_checkpoint(cfg, run_dir)}"
        if watch.intact():
            flight_recorder.dump(run_dir, ctx.rank, ctx.world_size, e.line().removeprefix("dtlab: "))
            if ctx.is_main and not e.quiet:
                record_stop(run_dir, e)
        raise
    except (ConfigError, RunDirGone, PeerSawRunDirGone, run_owner.RunComplete):  # nothing to record
        raise
    except Exception as e:
        if watch.intact():
            flight_recorder.dump(run_dir, ctx.rank, ctx.world_size, str(e).strip().split("\n")[0])
        if isinstance(e, torch.OutOfMemoryError):  # in set-up or after the steps (they say which)
            raise RunError(out_of_memory(e, "outside the training steps", ctx, run_dir)) from None
        raise
    if ctx.is_main and watch.intact():
        record_stop(run_dir, None)
    return summary


def _train(cfg: Config, ctx: DistContext, run_dir: Path, watch: DirectoryWatch) -> dict[str, Any]:
    started = time.perf_counter()
    numerics.apply(cfg.run, ctx.device)  # before any kernel runs
    tr, train_set, loader, val_loader = build(cfg, ctx)
    strategy, fault = tr.strategy, tr.stepper.fault
    run = RunState(total_steps=total_steps(cfg, loader), steps_per_epoch=loader.steps_per_epoch,
                   started=started,
                   usage=SampleUsage(len(train_set)) if cfg.run.track_samples else None)
    torch.manual_seed(cfg.seed + ctx.rank)  # per-rank randomness (dropout) from here on

    # Resume: model, optimizer, schedule, RNG and the position in the data order.
    path = state.resume_path(cfg, run_dir, ctx)
    if path is not None:
        manifest = state.load(path, cfg, ctx, tr)
        run.start, run.run_id = manifest["step"], run_owner.run_id_of(manifest) or ""
        run.step, run.resumed_from = run.start, path
        tr.stepper.step_number = run.start
        if run.start > run.total_steps:  # its summary would describe no step at all
            raise ConfigError(f"checkpoint {path} is at step {run.start}, past this run's last "
                              f"step {run.total_steps}; fix: train.max_steps={run.start} or more "
                              "to continue it, or resume=none run.overwrite=true to start over")
        if run.done and run_owner.summary_step(run_dir) == run.start:
            raise run_owner.RunComplete(
                f"run.dir '{run_dir}' holds this run complete at step {run.start}; its summary "
                "stands and nothing was written (to train on, raise train.max_steps; to start "
                "over, resume=none run.overwrite=true)")
    check_fault(cfg.run.fault, ctx.world_size, run.total_steps)  # one that can fire
    run_owner.begin(run, ctx, cfg, path, watch)
    profiler, snapshot = windows(cfg, run_dir, ctx, run.total_steps, run.start)
    # The trackers first: one that cannot start stops the run before it writes anything.
    trackers = open_trackers(cfg, run_dir, resumed=path is not None) if ctx.is_main else None
    log = MetricsLog(run_dir, ctx.is_main, run.total_steps, cfg.run.progress, trackers,
                     resume_step=run.start if path is not None else None)
    run.lost_steps = log.lost_steps
    if path is not None and ctx.is_main:
        done = (" (the run is complete: evaluating only; resume=none run.overwrite=true starts "
                "over)" if run.done else "")
        print(f"dtlab: resuming from {path} at step {run.start}{done}; steps lost since that "
              f"checkpoint: {log.lost_steps}", file=sys.stderr, flush=True)
        schedule_note(manifest, cfg, run, loader.steps_per_epoch)
    if ctx.is_main:
        try:
            # run.overwrite is an action of this start, not the run's: `--config RUN/config.yaml`
            # later must not delete the run without being asked again
            kept = cfg.model_copy(update={"run": cfg.run.model_copy(update={"overwrite": False})})
            files.write_text(run_dir / "config.yaml", to_yaml(kept), "run.dir")
        except DtlabError:
            log.close()  # the trackers' runs end (failed) with the run
            raise
    run.epoch = run.start // loader.steps_per_epoch

    def evaluate() -> None:
        run.evals = {"step": run.step, "epoch": run.epoch,
                     **strategy.evaluate(tr.forward, val_loader)}
        log.log(run.evals)

    tr.model.train()
    run.peaks.update(restart_peak(ctx.device, "setup"))
    trained = False  # the trackers' runs end with the summary, or here when training failed
    try:
        # A signal in the loop stops all ranks after the same step (dtlab/process/interrupt.py).
        with interrupt.deferred(STOP_DEADLINE_S):
            boundary, longest, vote = time.perf_counter(), 0.0, StopVote(ctx)
            for epoch, step_idx in islice(loader.steps(run.start),
                                          max(0, run.total_steps - run.start)):
                step = run.begin_step(epoch)
                with profiler.step(step), snapshot.step(step):
                    fault.before_step(step)
                    t0 = time.perf_counter()
                    lr = tr.scheduler.get_last_lr()[0]
                    with profiler.region("data"):
                        batches = [train_set.batch(i) for i in step_idx]
                        if run.usage is not None:
                            run.usage.add(step_idx)
                        ctx.synchronize()
                    data_time = time.perf_counter() - t0
                    with flight_recorder.step_window(run_dir, step, ctx.rank):
                        step_loss = tr.stepper(batches)
                    ctx.synchronize()
                    run.record_step(time.perf_counter() - t0, data_time)
                if len(run.step_times) == cfg.run.timing_warmup_steps:  # timed steps from here
                    run.peaks.update(restart_peak(ctx.device, "warmup"))
                log_step(cfg, tr, run, step_loss, lr, log)
                saved = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0
                busy_from = time.perf_counter()
                with interrupt.busy():
                    if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or \
                            (not cfg.train.eval_every and run.end_of_epoch) or run.done:
                        evaluate()
                    if saved:
                        state.save(cfg, ctx, tr, run)
                busy = time.perf_counter() - busy_from
                stop_at_boundary(cfg, ctx, tr, run, run_dir, bool(saved), vote, run.step_times[-1])
                # A step that takes over 3 x the longest interval between two boundaries so far
                # is a hang: a stop does not wait for it (evaluations and saves are waited for).
                reached = time.perf_counter()
                longest = max(longest, reached - boundary)
                run.record_loop(reached - boundary - busy, tr.stepper.engine_s)
                interrupt.set_deadline(max(STOP_DEADLINE_S, 3 * longest))
                boundary = reached
        if not run.evals:  # resumed a finished run: evaluate what it left
            evaluate()
        if cfg.train.checkpoint_every and \
                not (checkpoint.checkpoint_root(run_dir) / f"step_{run.step:06d}").is_dir():
            state.save(cfg, ctx, tr, run)  # the end of the run (or of a resumed run, here in run.dir)
        check_directory(ctx, watch, run.step)  # the summary goes where the run began
        trained = True
    except torch.OutOfMemoryError as e:
        held = strategy.state_bytes(tr.model, tr.optimizer)
        raise RunError(out_of_memory(e, f"at step {run.step}", ctx, run_dir, held,
                                     snapshot)) from None
    except RuntimeError as e:
        if ctx.world_size > 1 and is_comm_failure(e):
            interrupt.mark_collateral()  # a stop from here on is explained by the failed rank
            if interrupt.requested():
                raise Interrupted(interrupt.requested() or 0, quiet=True) from None
            raise RunError(who_stopped(ctx, run.step, e)) from None
        raise
    except Interrupted as e:  # forced: a hang, a second Ctrl-C, or after the last step
        done = run.start + len(run.step_times)
        e.where = e.where or (f" after the last step ({done}), before the summary was written; "
                              f"{resume_hint('resume=auto writes it')}" if run.done and done == run.step else
                              f" during step {done + 1}{last_checkpoint(cfg, run_dir)}")
        raise
    finally:
        log.close(keep_trackers=trained)  # the progress bar too: the terminal is left clean
        profiler.close(complete=False, write=watch.intact())  # stopped inside the window: its trace so far
        snapshot.stop()

    try:
        summary = summarize(cfg, ctx, tr, run)
        if profiler.result:
            summary["profile"] = profiler.result
        if snapshot.files:
            summary["memory_snapshot"] = snapshot.files
        if cfg.run.save_model:
            save_model(strategy, tr.model, run_dir / "model.safetensors", ctx)
        if cfg.run.comm_breakdown and ctx.world_size > 1:  # after training: it changes the model
            more = [[train_set.batch(i) for i in idx] for _, idx in
                    islice(loader.steps(start_step=run.total_steps), cfg.run.breakdown_steps)]
            trace = run_dir / f"trace_rank{ctx.rank}.json" if cfg.run.profile_trace else None
            summary.update(comm_breakdown(cfg, ctx, tr, more, trace))
        log.write_summary(summary)
    except Interrupted as e:
        e.where = e.where or (f" after the last step ({run.step}), before the summary was "
                              f"written; {resume_hint('resume=auto writes it')}")
        raise
    finally:
        log.close()
        strategy.close()
    return summary


def schedule_note(manifest: dict[str, Any], cfg: Any, run: RunState, steps_per_epoch: int) -> None:
    """A resume for another number of steps stretches (or shrinks) a decaying schedule: said in
    one line, since the learning rate from here on is not where the earlier run was heading."""
    earlier = (manifest.get("config") or {}).get("train") or {}
    if cfg.train.schedule == "constant" or not isinstance(earlier, dict):
        return
    total = earlier.get("max_steps") or (earlier.get("epochs") or 0) * steps_per_epoch
    if isinstance(total, int) and total and total != run.total_steps:
        print(f"dtlab: warning: the {cfg.train.schedule} learning-rate schedule now spans "
              f"{run.total_steps} steps, not the {total} the checkpoint was trained for: from "
              f"step {run.start + 1} the learning rate is a {run.total_steps}-step run's, not "
              "where the earlier run was heading", file=sys.stderr, flush=True)


def run(config: str | None, overrides: list[str]) -> int:
    """Worker entry: validate, set up the process group, train, always tear down. Returns exit code."""
    env = detect_env()
    with interrupt.handling():
        try:
            return _run(config, overrides, env)
        except Interrupted as e:  # rank 0 says where the run stopped, once
            if env.world_size > 1:
                _FAILED.append(e)
            return interrupt.report(e, main=env.rank == 0)


def _run(config: str | None, overrides: list[str], env: Any) -> int:
    with contextlib.ExitStack() as lock:
        try:
            cfg = load_config(config, overrides)
            check_world(cfg, env.world_size, env.local_world_size)
            check_environment(cfg)
            if env.rank == 0:  # the run directory's lock, unless this rank's launcher holds it
                lock.enter_context(dir_lock.held(cfg.run.run_dir))
            check_paths(cfg, config)
        except DtlabError as e:
            if env.rank == 0:  # every rank finds the same problem: say it once
                print(f"dtlab: error: {e}", file=sys.stderr)
            return 2
        return _train_in_group(cfg, env)


def _train_in_group(cfg: Config, env: Any) -> int:
    try:
        r = cfg.run
        flight_recorder.enable(r.flight_recorder if env.world_size > 1 else 0,
                               r.run_dir, r.device)
        with distributed(r.device, r.backend, r.timeout_s, r.threads,
                         need_group=not registry.of(cfg).one_process, env=env,
                         destroy=not cfg.lab.no_destroy_process_group) as ctx:
            train(cfg, ctx)
    except run_owner.RunComplete as e:
        if env.rank == 0:
            print(f"dtlab: {e}", file=sys.stderr)
        return 0
    except DtlabError as e:
        # The rank that failed first-hand explains it; a config problem found in set-up is the
        # same on every rank: rank 0 says it.
        if not isinstance(e, PeerError) and (env.rank == 0 or not isinstance(e, ConfigError)):
            where = f"[rank {env.rank}] " if env.world_size > 1 else ""
            print(f"dtlab: error: {where}{e}", file=sys.stderr)
        if env.world_size > 1:
            _FAILED.append(e)
        return e.exit_code
    return 0


# A failed or stopped multi-rank run's error, kept until the process ends (distributed.leave:
# os._exit).
# Freeing its traceback frees the step's objects and with them the last reference to the process
# group, whose gloo destructor can then wait out the collective timeout for a peer that has
# already exited: a 2-rank run stopped on a deleted run directory sometimes ended only after
# run.timeout_s, its surviving rank caught at this function's return.
_FAILED: list[BaseException] = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (default: the built-in quick config)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.1")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return run(args.config, args.overrides)


if __name__ == "__main__":
    leave(main())


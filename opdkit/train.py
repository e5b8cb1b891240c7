"""The OPD training loop: one flat loop, top to bottom.

Output directory layout (the same for ``opdkit train --out DIR`` and run.sh's ``OUTPUT_DIR``)::

    config.yaml                       the resolved params of the latest start
    checkpoints/checkpoint-<step>/    complete HF exports, published atomically (newest publish.keep)
    metrics/train.jsonl               one JSON object per step
    dvclive/ or tensorboard/          the same steps through the ``tracking`` logger (``opdkit.tracking``)
    state/trainer_state-<step>/       what resume needs (weights or adapter, optimizer, step, data
                                      position, RNG, elapsed wall time); streamed, atomic
                                      (``opdkit.persist.trainer_state``; in runtime.state_dir instead when
                                      it is set: run.sh's CKPT_DIR, with a lock of its own)
    run.json                          the latest start: running / completed / stopped (by a signal) /
                                      failed (+ reason, step; ``nonfinite`` / ``out_of_memory`` /
                                      ``collective_failure``)
    .opdkit.lock                      held while a run writes here (a second run fails at once)

Every input is validated before anything in the directory is created or changed. Saves: an HF
export every ``publish.every_steps`` and a trainer state every ``publish.state_every_steps`` (-1:
with each export), and at the end both, the checkpoint first. So a ``checkpoint-<step>`` may be
newer than the newest state; every checkpoint comes from a state at or before its step by
deterministic steps, and a start that resumes behind one replays those steps without exporting them
(``opdkit.persist.rundir``; an older export would make retention drop a newer one).

The end of the wall budget (``opdkit.deadline``): a step starts only if it and the final saves (their
measured seconds, or before the first an estimate from their bytes and a write probe) end
``budget.deadline_reserve_s`` before ``budget.max_wall_time_s``; a rollout that runs past the point
where its step can no longer end in time is abandoned between decode steps (``interrupt.deadline``),
as is one in flight when a stop signal arrives. run.json records what the stop reserved and every
save's seconds.

Starting again on the same directory resumes from ``state/``: the step count, data position,
per-sample seeds and RNG continue exactly (an interrupted run ends with the same weights as an
uninterrupted one), metrics lines past the saved step (from a killed attempt) are dropped and new
ones appended, and the wall-clock budget counts the time already spent, including the steps that
were lost. Only budgets, publishing, runtime and paths may change between starts; the data must be
the same (fingerprint). A step-based schedule's horizon (``budget.schedule_steps``, else
``budget.max_steps``) may not change either: a new ``max_steps`` with ``optim.schedule`` linear or
cosine is refused unless ``budget.schedule_steps`` keeps the old horizon. A run that already
reached its end returns at once.

Under ``torchrun`` (``opdkit.distributed``) every rank runs this loop on its share of each step's
prompts with the student sharded by FSDP2; rank 0 alone holds the lock and writes the directory.
The state is the same as a single process's, so a run resumes under any world size that divides
``rollout.prompts_per_step``.

Faults (``opdkit.guards``): a non-finite loss or gradient norm stops the run before the optimizer
steps (``runtime.on_nonfinite: stop``; ``skip`` drops the update and logs ``skipped_nonfinite``,
up to ``runtime.max_nonfinite_skips`` steps in a row), and parameters are checked after it; a
device out-of-memory error names its phase. Both save nothing new: the last good state and
checkpoints stay, and a rerun resumes from them. A stop signal (``opdkit.interrupt``, read here
between steps and agreed on by all ranks) ends the run: a rollout in flight is abandoned at its next
token (a step past its rollout finishes; one whose teacher fails after the signal, e.g. a vLLM
engine process that stopped on the same signal, is abandoned), and the state and (when the wall
budget is not spent) the checkpoint of the last complete step are saved.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from opdkit import (
    deadline,
    distributed,
    guards,
    interrupt,
    loss_table,
    overlap,
    step as opd_step,
    tracking,
)
from opdkit.config import Config, to_dict
from opdkit.data import prompt_indices  # noqa: F401 (the data stream: opdkit.train.prompt_indices as before)
from opdkit.engines.select import engine_name, make_engine
from opdkit.persist import trainer_state
from opdkit.persist.fsutil import OutputLock, atomic_write_json, list_checkpoints
from opdkit.persist.publish import Publisher
from opdkit.persist.rundir import (
    METRICS_FILE,
    RUN_FILE,
    Start,
    TrainResult,
    begin,
    check_output_dir,
    finish,
    is_published,
    step_row,
)
from opdkit.persist.weights_io import export_dtype
from opdkit.schedules import lr_at, should_stop, wallclock_clock
from opdkit.setup import Inputs, Run, RunError, build_run, code_revision, prepare_inputs

# --- publishing and stopping ------------------------------------------------------------------


def _publish(publisher, run: Run, step: int, elapsed: float) -> None:
    """Submit the export of ``checkpoint-<step>`` (written in the background on rank 0). The weights
    are cast to the export dtype where they live and copied into the publisher's reused host memory
    (``publish.Snapshot``), once the previous export has finished: that memory was its snapshot."""
    publisher.wait()
    t0 = time.monotonic()
    meta = {
        "step": step, "elapsed_s": round(elapsed, 3), "params": to_dict(run.cfg),
        "data_fingerprint": run.inputs.data_fingerprint, "data_path": str(run.inputs.train_path),
        "code_revision": run.code_revision, "source_student": str(run.inputs.student_path),
        "run_id": run.run_id,
    }
    base = run.student.get_base_model() if hasattr(run.student, "get_base_model") else run.student
    snapshot = getattr(publisher, "snapshot", None)
    state_dict = distributed.gather_weights(run.student, dtype=run.publish_dtype,
                                               copy=snapshot.copy if snapshot is not None else None)
    if snapshot is not None:
        snapshot.done()
    publisher.submit(step=step, state_dict=state_dict, model_config=base.config, tokenizer=run.tokenizer,
                     generation_config=base.generation_config, meta=meta, dtype=run.publish_dtype,
                     started_at=t0)


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":  # this rank's GPU
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _clock(device: torch.device) -> float:
    """Wall time after the device's queued work is done (else GPU seconds land in the next phase)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic()


def _stop_signal(world: distributed.World) -> str | None:
    """The name of a stop signal any rank received (every rank gets the same answer), else None."""
    (signum,) = world.max(interrupt.requested())
    return signal.Signals(int(signum)).name if signum else None


# --- the run ----------------------------------------------------------------------------------


def preflight(cfg: Config, out: str | Path) -> Inputs:
    """Every check ``train`` makes before it writes anything: inputs, params, and whether ``out``
    holds a run these params may resume. Reads ``out``, never changes it."""
    inputs = prepare_inputs(cfg)
    distributed.check_params(cfg, distributed.current())
    try:  # (publish.max_shard_size and runtime.max_nonfinite_skips: checked with the params, opdkit.config)
        export_dtype(cfg.publish.dtype, inputs.student_path)
        tracking.resolve(cfg.tracking)
    except ValueError as e:
        raise RunError(str(e)) from None
    check_output_dir(Path(out), cfg, inputs)
    return inputs


def train(cfg: Config, out: str | Path, log=print, progress: bool = True,
          started_at: float | None = None) -> TrainResult:
    """One OPD run into ``out`` (or the rest of one); raises on any failure (the caller maps it to
    an exit status). ``RunError``/``DataError``/``ModelError``/``ConfigError`` raised before the
    lock is taken leave ``out`` exactly as it was; ``LockHeld`` if another run writes there.
    ``started_at``: the ``time.monotonic()`` the wall budget counts from (the command line passes
    ``deadline.started_at()``: the launch, start-up included); default now."""
    t_start = time.monotonic() if started_at is None else started_at  # the wall budget includes start-up
    out = Path(out)
    world = distributed.current()
    if not world.is_main:  # rank 0 alone logs and writes the output directory
        log, progress = (lambda *args, **kwargs: None), False
    inputs = preflight(cfg, out)
    for w in inputs.warnings:  # the pair checks' WARN lines (opdkit doctor shows every check)
        log(f"warning: {w.check}: {w.detail}")
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
    at = guards.StepProgress()  # which step and phase runs (for an out-of-memory message)
    with contextlib.ExitStack() as locks:
        if world.is_main:
            locks.enter_context(OutputLock(out))
            # CKPT_DIR: a lock of its own
            if cfg.runtime.state_dir and Path(cfg.runtime.state_dir).resolve() != out.resolve():
                locks.enter_context(OutputLock(cfg.runtime.state_dir, "trainer state directory"))
        try:
            try:
                return _train_locked(cfg, inputs, out, log, progress, t_start, world, at)
            except torch.OutOfMemoryError as e:
                raise guards.out_of_memory(e, at) from e
            except RuntimeError as e:  # torchrun: a collective timed out (runtime.collective_timeout_s) or lost a rank
                if not distributed.is_collective_failure(e, world):
                    raise
                raise distributed.CollectiveFailure(at.step, at.phase, e, cfg.runtime.collective_timeout_s) from e
        except BaseException as e:
            if not world.is_main:
                raise
            try:  # best effort: the failure itself may be the file system
                atomic_write_json(out / RUN_FILE, {"status": "failed", "error": f"{type(e).__name__}: {e}",
                                                   **getattr(e, "record", {}),
                                                   "checkpoints": [c.name for c in
                                                                   list_checkpoints(out / "checkpoints")]})
            except OSError:
                pass
            raise


@dataclass
class _Loop:
    """What the loop runs with, built once per start by ``_setup``."""
    run: Run
    sampling: opd_step.Sampling  # who draws a step's samples (the student's engine, the sft control's, this rank's)
    publisher: Publisher | distributed.NullPublisher
    metrics_f: object  # train.jsonl, appended to (os.devnull on ranks other than 0)
    tracker: tracking.Tracker
    published_step: int | None  # the newest step whose checkpoint is published or being published
    state_step: int | None  # the step of the newest trainer state (None: none saved)
    ahead: int | None  # a checkpoint newer than the state this start resumed from: steps up to it are not exported
    clock: deadline.SaveClock  # the saves' seconds (measured, or estimated until they are)
    exports_seen: int = 0  # the publisher's export timings already in ``clock``


def _setup(cfg: Config, inputs: Inputs, out: Path, log, t_start: float, world: distributed.World,
           start: Start) -> _Loop:
    """Build the run (restored from ``start.state``, sharded under torchrun), its samplers, the
    publisher and metrics file; publish the restored weights if they never were (and no newer
    checkpoint is there); measure the write rate the first saves are estimated at; open the tracker."""
    state = start.state
    state_step = start.step if state is not None else None
    run = build_run(cfg, inputs, log)
    run.code_revision = code_revision()
    run.run_id = start.run_id
    # states saved before the key existed: their schedule started at 0 s
    run.lr_clock_start_s = state.get("lr_clock_start_s", 0.0) if state is not None else None
    run.publish_dtype = export_dtype(cfg.publish.dtype, inputs.student_path)
    if state is not None:
        trainer_state.restore(run, state)  # unsharded, on every rank
    pending = state.get("pending_rollout") if state is not None else None
    start.state = state = None  # restored into the run
    if world.active:  # torchrun: shard the student (and teacher) over the ranks
        run = distributed.shard_run(run, world)
    if world.is_main:
        publisher = Publisher(out / "checkpoints", keep=cfg.publish.keep, retries=cfg.publish.retries,
                              backoff_s=cfg.publish.backoff_s, max_shard_size=cfg.publish.max_shard_size, log=log)
        (out / "metrics").mkdir(exist_ok=True)
        metrics_f = (out / METRICS_FILE).open("a")
    else:
        publisher, metrics_f = distributed.NullPublisher(), open(os.devnull, "w")
    # offline: the pool serves the stored samples (it is the run's teacher too: opdkit.offline); else the student's
    # sampler
    engine = run.teacher if cfg.rollout.source == "offline" else make_engine(cfg, run.student, run.tokenizer)
    # the sft control samples from the teacher: its engine is built once, not every step
    teacher_engine = (make_engine(cfg, run.teacher, run.tokenizer)
                      if loss_table.samples_from(cfg.loss) == "teacher" else None)
    interrupt.ensure_installed(log)  # the engines are built: our stop-signal handlers are the ones in place
    if cfg.rollout.overlap:  # one-step-off: the next step's batch is drawn while this one trains (opdkit.overlap)
        engine = overlap.Lookahead(engine, run.autocast, run.device)
        engine.restore(pending)
    engine.sync_weights(run.student)  # an engine with weights of its own (vLLM) starts from the live ones
    mine = world.share(cfg.rollout.prompts_per_step)  # mine.start .. mine.stop-1 (global sample seeds)
    reads_logp = loss_table.reads_sampling_logp(cfg.loss, cfg.rollout)
    b = cfg.budget
    rate = 0.0
    if world.is_main and b.max_wall_time_s > 0 and b.write_probe_mb > 0:
        rate = deadline.probe_write_rate([trainer_state.directory(out, cfg.runtime.state_dir), out / "checkpoints"],
                                         b.write_probe_mb << 20)
        log(f"write probe: {b.write_probe_mb} MiB at {rate / 1e9:.2f} GB/s (the first saves are reserved at their "
            f"bytes over this rate x {b.save_estimate_factor:g})")
    clock = deadline.SaveClock(deadline.state_bytes(run.student, run.ema),
                               deadline.export_bytes(run.student, run.publish_dtype), rate,
                               b.save_estimate_factor)
    sampling = opd_step.Sampling(engine, teacher_engine, mine, reads_logp)
    lp = _Loop(run, sampling, publisher, metrics_f, tracker=None, published_step=None, state_step=state_step,
               ahead=start.ahead, clock=clock)
    step = start.step
    if step and world.from_main(is_published(out, step)):
        lp.published_step = step
    elif step and start.ahead is None:
        _publish(publisher, run, step, start.elapsed0 + time.monotonic() - t_start)  # never published: do it now
        lp.published_step = step
    # DVCLive / TensorBoard beside train.jsonl (rank 0); its history is rebuilt from train.jsonl's kept rows
    lp.tracker = (tracking.Tracker(tracking.resolve(cfg.tracking), out, out / METRICS_FILE, to_dict(cfg), log)
                  if world.is_main else tracking.Tracker("none"))
    return lp


def _set_lr(cfg: Config, run: Run, step: int, elapsed: float, last_step_s: float, save_s: float) -> float:
    """The learning rate of step ``step + 1``, set on the optimizer (the run's first step starts the
    wall-clock schedule, which ends when the loop will stop: see ``schedules.should_stop``)."""
    if run.lr_clock_start_s is None:
        run.lr_clock_start_s = elapsed
    lr_elapsed_s, lr_budget_s = wallclock_clock(elapsed, run.lr_clock_start_s, cfg.budget.max_wall_time_s,
                                                cfg.budget.deadline_reserve_s, last_step_s, save_s)
    lr = lr_at(cfg.optim.schedule, step=step, total_steps=cfg.budget.schedule_steps or cfg.budget.max_steps,
               elapsed_s=lr_elapsed_s, budget_s=lr_budget_s, lr=cfg.optim.lr, min_lr=cfg.optim.min_lr,
               warmup_steps=cfg.optim.warmup_steps)
    for g in run.optimizer.param_groups:
        g["lr"] = lr
    return lr


def _save(cfg: Config, out: Path, lp: _Loop, step: int, elapsed: float, data_pos: int, log) -> None:
    """The trainer state at ``step`` (every rank writes its part), once the previous export has
    succeeded; timed for the stop rule."""
    lp.publisher.wait()
    interrupt.ensure_installed(log)  # a save is never cut short by a handler that is not ours
    t0 = time.monotonic()
    pending = lp.sampling.engine.state() if cfg.rollout.overlap else None
    path = trainer_state.save(out, lp.run, step, elapsed, data_pos, log, pending)
    seconds = time.monotonic() - t0
    lp.state_step = step
    nbytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if distributed.current().is_main else 0
    e = lp.clock.record("state", step, nbytes, seconds)
    log(f"saved the trainer state at step {step} ({path}): {e['gb']} GB in {e['s']} s, {e['gb_per_s']} GB/s")


def _collect_exports(lp: _Loop) -> None:
    """The seconds of the exports that finished since the last call (snapshot to files in place), into ``lp.clock``."""
    timings = getattr(lp.publisher, "timings", [])
    for t in timings[lp.exports_seen:]:
        lp.clock.record("export", t["step"], t["bytes"], t["seconds"])
    lp.exports_seen = len(timings)


def _replayed(lp: _Loop, step: int) -> bool:
    """``step``'s checkpoint was published by an earlier start (this one replays behind it): not exported again
    (publishing an older step would make retention drop a newer one)."""
    return lp.ahead is not None and step <= lp.ahead


def _state_due(cfg: Config, step: int, export_due: bool) -> bool:
    n = cfg.publish.state_every_steps
    return export_due if n < 0 else bool(n) and step % n == 0


def _publish_final(cfg: Config, out: Path, lp: _Loop, reason: str, step: int, start_step: int, elapsed: float,
                   data_pos: int, log) -> None:
    """The end: the checkpoint of the last complete step first (it is what the wall budget is for),
    then its trainer state, each unless already there, and we wait until both are complete. A stop
    signal before any step of this start saves nothing new; one past the wall budget saves the state
    only (a rerun publishes it)."""
    if not (reason.startswith("SIG") and step == start_step):
        late = reason.startswith("SIG") and cfg.budget.max_wall_time_s and elapsed >= cfg.budget.max_wall_time_s
        if lp.published_step != step and not _replayed(lp, step):
            if late:
                log(f"stop requested past the wall budget: saving the state at step {step}, not its checkpoint "
                    "(a rerun publishes it)")
            else:
                _publish(lp.publisher, lp.run, step, elapsed)
                lp.published_step = step
        if lp.state_step != step:
            _save(cfg, out, lp, step, elapsed, data_pos, log)
    lp.publisher.close()  # raises PublishError if any export failed
    _collect_exports(lp)


_SIGNAL_CODE = 1000  # a step abandoned by signal N is agreed on as _SIGNAL_CODE + N over the ranks (1: the wall clock)


def _abandoned_on_ranks(world: distributed.World, reason: str | None) -> str | None:
    """The ranks agree on whether the step in flight was abandoned, and why (a signal wins over the wall clock)."""
    if not world.active:
        return reason
    code = 0 if reason is None else 1 if reason == "wall_clock" else _SIGNAL_CODE + int(signal.Signals[reason])
    (code,) = world.max(code)
    return None if code == 0 else "wall_clock" if code == 1 else signal.Signals(int(code) - _SIGNAL_CODE).name


def _rng_states(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if device.type == "cuda" else None


def _set_rng_states(states: tuple) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state_all(states[1])


def _train_locked(cfg: Config, inputs: Inputs, out: Path, log, progress: bool, t_start: float,
                  world: distributed.World, at: guards.StepProgress) -> TrainResult:
    start = begin(cfg, inputs, out, log, t_start, world)
    if start.done:
        return start.done
    lp = _setup(cfg, inputs, out, log, t_start, world, start)
    run, step, data_pos, elapsed0, b = lp.run, start.step, start.data_pos, start.elapsed0, cfg.budget
    start_step = first_step = step  # the alignment check runs on the first batch of every start (step.alignment_due)
    skips, last_step_s, after_rollout_s = 0, 0.0, 0.0  # skips: non-finite updates dropped in a row
    bar = tqdm(total=cfg.budget.max_steps or None, initial=step, desc="train", unit="step", disable=not progress)
    with lp.publisher, lp.metrics_f, bar, lp.tracker:
        while True:
            lp.publisher.check()  # a failed background export stops the run here, never silently
            _collect_exports(lp)
            save_s, parts = lp.clock.reserve() if b.max_wall_time_s else (0.0, {})
            # rank 0's clock for all: the same stop decision and wall-clock learning rate everywhere
            elapsed, last_step_s, save_s, after_rollout_s = world.broadcast(
                elapsed0 + time.monotonic() - t_start, last_step_s, save_s, after_rollout_s)
            reason = should_stop(step, elapsed, last_step_s, save_s, budget=cfg.budget) or _stop_signal(world)
            abandoned = None
            if not reason:
                at.step, at.phase = step + 1, "rollout"
                t0 = _clock(run.device)
                lr = _set_lr(cfg, run, step, elapsed, last_step_s, save_s)
                # the rollout ends by the point where the saves must start, less the rest of its step (as long as
                # the last one's; unknown for a start's first step): else it is abandoned between decode steps
                left = deadline.rollout_deadline_s(b.max_wall_time_s, b.deadline_reserve_s, save_s, after_rollout_s,
                                                   elapsed)
                rng = _rng_states(run.device)
                try:
                    with interrupt.deadline(None if left is None else time.monotonic() + left):
                        # 1. rollout, 2. teacher scoring, 3. loss + backward, 4. update
                        check = opd_step.alignment_due(step, first_step, runtime=cfg.runtime)
                        batch, reward, lag = opd_step.draw(
                            cfg.loss, inputs, run, lp.sampling, world, step, data_pos, check, elapsed, last_step_s,
                            save_s, seed=cfg.seed, data=cfg.data, rollout=cfg.rollout, budget=cfg.budget,
                            teacher_source=cfg.teacher.source)
                except interrupt.StepAbandoned as e:
                    abandoned = e.reason
                abandoned = _abandoned_on_ranks(world, abandoned)
                if abandoned:
                    _set_rng_states(rng)  # as if the step had never started: a resumed run draws it again
                    reason = abandoned
                    log(f"step {step + 1} abandoned during its rollout after {time.monotonic() - t0:.1f}s "
                        f"({abandoned}): its weights were not updated; saving step {step}")
            if reason:
                stop = deadline.decision(reason, step, elapsed, last_step_s, save_s, parts, b.max_wall_time_s,
                                         b.deadline_reserve_s, bool(abandoned))
                if b.max_wall_time_s:
                    log(f"stopping at step {step} ({reason}) after {elapsed:.1f}s of the {b.max_wall_time_s:g}s "
                        f"budget; reserved {stop['reserved_s']:.1f}s: next step {last_step_s:.1f}s, "
                        f"saves {save_s:.1f}s ("
                        + ", ".join(f"{k} {v['s']:.1f}s {v['basis']}" for k, v in parts.items())
                        + f"), deadline reserve {b.deadline_reserve_s:g}s")
                break
            t1 = _clock(run.device)
            align = opd_step.check_alignment(
                cfg.loss, run, batch, lag, step, log, rollout=cfg.rollout, runtime=cfg.runtime,
                teacher_source=cfg.teacher.source, engine=engine_name(cfg, run.device)) if check else None
            at.phase = "score"
            try:
                contexts = opd_step.score_batch(cfg.loss, run.teacher, batch, run.autocast, run.teacher_ctx,
                                                rollout=cfg.rollout, runtime=cfg.runtime,
                                                micro_batch=cfg.optim.micro_batch)
            except Exception as e:  # a teacher in a process of its own (vLLM) may stop on the same signal as we did
                if world.active or cfg.rollout.overlap or not interrupt.requested():
                    raise
                reason = signal.Signals(interrupt.requested()).name
                log(f"step {step + 1}: the teacher failed after {reason} ({type(e).__name__}: {e}); the step is "
                    f"abandoned, its weights were not updated; saving step {step}")
                _set_rng_states(rng)
                stop = deadline.decision(reason, step, elapsed, last_step_s, save_s, parts, b.max_wall_time_s,
                                         b.deadline_reserve_s, True)
                break
            t2 = _clock(run.device)
            at.phase = "update"
            m, n_tok, n_seq, n_trunc = opd_step.loss_and_backward(
                cfg.loss, run, world, batch, contexts, reward, rollout=cfg.rollout, runtime=cfg.runtime,
                micro_batch=cfg.optim.micro_batch, teacher_names=tuple(t.name for t in cfg.teachers),
                vocab_map=cfg.teacher.vocab_map)
            grad_norm, bad, skips = opd_step.update(
                run, lp.sampling.engine, m, step + 1, skips, log, grad_clip=cfg.optim.grad_clip,
                on_nonfinite=cfg.runtime.on_nonfinite, max_skips=cfg.runtime.max_nonfinite_skips,
                ema_decay=cfg.teacher.ema_decay)
            step, data_pos = step + 1, data_pos + cfg.rollout.prompts_per_step
            at.phase = "bookkeeping"
            t3 = _clock(run.device)
            last_step_s, after_rollout_s = t3 - t0, t3 - t1
            elapsed = elapsed0 + t3 - t_start
            # waiting for the prefetch: rollout time
            waited = lp.sampling.engine.pop_waited() if cfg.rollout.overlap else 0.0
            row = step_row(step, elapsed, lr, m, grad_norm, n_tok, n_seq, n_trunc, last_step_s,
                           (t1 - t0 + waited, t2 - t1, t3 - t2 - waited), world.max(_peak_memory_gb(run.device))[0],
                           lag if cfg.rollout.overlap else None, align, bad)
            lp.metrics_f.write(json.dumps(row) + "\n")
            lp.metrics_f.flush()
            lp.tracker.log(row)  # DVCLive / TensorBoard (a failure there warns and stops tracking, not the run)
            _reset_peak_memory(run.device)  # the next row's peak: its step, and any publishing before it
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.4f}", kl=f"{m.get('kl') or 0:.4f}", s=f"{last_step_s:.2f}")
            export_due = bool(cfg.publish.every_steps) and step % cfg.publish.every_steps == 0
            if _state_due(cfg, step, export_due):
                at.phase = "publish"
                _save(cfg, out, lp, step, elapsed, data_pos, log)
            if export_due and not _replayed(lp, step):
                at.phase = "publish"
                _publish(lp.publisher, run, step, elapsed)
                lp.published_step = step
        at.phase = "publish"
        _publish_final(cfg, out, lp, reason, step, start_step, elapsed, data_pos, log)
    elapsed_end = elapsed0 + time.monotonic() - t_start
    record = {"stop": stop, "saves": lp.clock.saves, "ended_s": round(elapsed_end, 3)}
    if b.max_wall_time_s:
        log(f"the final saves ended at {elapsed_end:.1f}s of the {b.max_wall_time_s:g}s budget")
    return finish(out, reason, step, elapsed, log, world, cfg.experiment_name, lp.tracker.record, record)

"""The output directory of a run (its layout: ``opdkit.train``): whether a start may resume the run
it holds, train.jsonl's rows (and dropping those a killed attempt left), run.json's record of the end.

A run is identified by the ``run_id`` that run.json carries from start to start and that every
checkpoint's ``opdkit.json`` and trainer state records. A directory whose checkpoints are newer than
its newest trainer state (``publish.state_every_steps`` apart from the export cadence, or a run
killed between the two saves) resumes from that state (or from the beginning when there is none)
and replays the steps since, if those checkpoints are this run's; checkpoints of another run
without their state are refused."""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from opdkit import distributed
from opdkit.config import Config, dump_yaml, to_dict, yaml_problem
from opdkit.persist import trainer_state
from opdkit.persist.checkpoints import is_valid_checkpoint, surviving_checkpoints_message
from opdkit.persist.fsutil import atomic_write_json, atomic_write_text, list_checkpoints, unwritable
from opdkit.schedules import should_stop
from opdkit.setup import Inputs, RunError

METRICS_FILE = "metrics/train.jsonl"
RUN_FILE = "run.json"
# Params sections that may change between the starts of one run; any other change would splice
# two different runs together. Paths may change too (files move), the data fingerprint may not.
RESUMABLE_SECTIONS = ("budget", "publish", "runtime", "eval", "studies", "doctor", "pipeline", "embedded", "tracking")
PATH_KEYS = ("student.path", "teacher.path", "data.train", "data.eval")
LABEL_KEYS = ("recipe", "experiment_name")  # names, not values: the values a recipe sets are compared
# where the teacher runs, not what it is: a resumed run may move it (another GPU, another server address)
PLACEMENT_KEYS = ("teacher.device", "teacher.url", "teacher.timeout_s", "teacher.gpu_memory_utilization")


@dataclass
class TrainResult:
    status: str  # "completed" | "stopped" (by a signal)
    reason: str  # "step_horizon" | "wall_clock" | the signal's name ("SIGTERM", "SIGINT")
    step: int
    elapsed_s: float
    checkpoints: list[str]
    # the newest valid checkpoint: checkpoint-<step>, or a newer one of a start that this one replayed behind
    final_checkpoint: str | None = None


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def check_resumable(cfg: Config, inputs: Inputs, state: dict, out: Path) -> None:
    """Refuse to continue a run in ``out`` with params or data that would make it a different run."""
    old, new = _flat(state["config"]), _flat(to_dict(cfg))
    fixed = [k for k in sorted(set(old) & set(new))  # a knob added to opdkit since then does not count
             if k.split(".")[0] not in RESUMABLE_SECTIONS and k not in PATH_KEYS + LABEL_KEYS + PLACEMENT_KEYS
             and old[k] != new[k]]
    if fixed:
        changes = ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in fixed[:4])
        raise RunError(f"{out} holds a run (step {state['step']}) with other params ({changes}); resume it with the "
                       "same values or choose another output directory")
    horizon = (old.get("budget.schedule_steps") or old.get("budget.max_steps"),
               cfg.budget.schedule_steps or cfg.budget.max_steps)  # (saved, these params')
    if cfg.optim.schedule in ("linear", "cosine") and horizon[0] is not None and horizon[0] != horizon[1]:
        raise RunError(f"{out} holds a run (step {state['step']}) whose optim.schedule={cfg.optim.schedule} runs over "
                       f"{horizon[0]} steps; these params would make it {horizon[1]} and reshape the learning rate "
                       f"from here on. Keep the horizon with budget.schedule_steps={horizon[0]} (budget.max_steps may "
                       "then change: steps past the horizon run at optim.min_lr), or choose another output directory")
    if state.get("data_fingerprint") not in (None, inputs.data_fingerprint):
        raise RunError(f"{out} holds a run (step {state['step']}) trained on other data than {inputs.train_path} "
                       "(fingerprints differ); resume it with the same data or choose another output directory")


def newest_checkpoint(out: Path) -> tuple[int, dict] | None:
    """(step, opdkit.json) of the newest valid checkpoint in ``out/checkpoints``, or None."""
    for c in reversed(list_checkpoints(out / "checkpoints")):
        if is_valid_checkpoint(c, full=False)[0]:
            try:
                return int(c.name.split("-")[1]), json.loads((c / "opdkit.json").read_text())
            except (OSError, ValueError):
                return int(c.name.split("-")[1]), {}
    return None


def run_id(out: Path) -> str | None:
    """The ``run_id`` run.json holds (None: no run.json, or one without it)."""
    return _run_json(out).get("run_id")


def _run_json(out: Path) -> dict:
    """run.json of ``out`` ({}: none, or not a JSON object)."""
    try:
        got = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def run_json_damage(out: Path) -> str | None:
    """What is wrong with ``out``'s run.json (None: absent, or a JSON object). It is written atomically, so
    a damaged one was changed from outside."""
    f = out / RUN_FILE
    if not f.exists():
        return None
    try:
        got = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        return f"cannot be read ({type(e).__name__}: {e})"
    return None if isinstance(got, dict) else f"is not a JSON object (it holds a {type(got).__name__})"


def ended_on_the_wall_clock(run_json: dict, state: dict | None, step: int, cfg: Config) -> bool:
    """run.json (``run_json``, read before this start) says the run completed at ``step`` on its wall budget,
    and the trainer state it resumes (``state``) ran under the same budget as ``cfg``: a rerun has nothing to do.
    (The loop stops when the next step is expected to end past the budget, so the elapsed time it saved can be
    short of the budget, and a rerun asking ``should_stop`` without the last step's length would train on.)"""
    return (state is not None and run_json.get("status") == "completed" and run_json.get("reason") == "wall_clock"
            and run_json.get("step") == step and state.get("config", {}).get("budget") == to_dict(cfg)["budget"])


def started_params(out: Path) -> dict | None:
    """The params config.yaml of ``out`` records (the latest start's; None: no config.yaml). ``RunError``
    when it is there but not a YAML mapping: opdkit writes it atomically, so it is someone else's file."""
    f = out / "config.yaml"
    if not f.is_file():
        return None
    try:
        got = yaml.safe_load(f.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        got = e
    if not isinstance(got, dict):
        why = (f"{type(got).__name__}: {yaml_problem(got) if isinstance(got, yaml.YAMLError) else got}"
               if isinstance(got, Exception) else f"it holds a {type(got).__name__}")
        raise RunError(f"{f} is not a params file opdkit wrote ({why}); a run here would overwrite it: move it away "
                       "or choose another output directory")
    return got


def check_output_dir(out: Path, cfg: Config, inputs: Inputs) -> None:
    """Read-only checks of ``out`` before anything is written (errors leave it as it was)."""
    if out.exists() and not out.is_dir():
        raise RunError(f"output directory {out} exists and is not a directory")
    state_dir = trainer_state.directory(out, cfg.runtime.state_dir)
    if state_dir.exists() and not state_dir.is_dir():
        raise RunError(f"trainer state directory {state_dir}{' (runtime.state_dir)' if cfg.runtime.state_dir else ''} "
                       "exists and is not a directory; name a directory (it is created if missing)")
    for path, what in ((out, "output directory"), (state_dir, "trainer state directory")):
        if problem := unwritable(path):  # else the lock, config.yaml or the first save fails with a traceback
            raise RunError(f"{what} {path} cannot be written: {problem}; choose a directory this process may write")
    state = trainer_state.peek(out, cfg.runtime.state_dir)
    if state is not None:
        check_resumable(cfg, inputs, state, out)
        return
    newest = newest_checkpoint(out)
    if newest is not None and newest[1].get("run_id") and newest[1].get("run_id") == run_id(out):
        # this run's checkpoints, its state never saved (publish.state_every_steps=0, or killed before the first):
        # it starts again from the beginning and replays the steps they hold
        meta = newest[1]
        check_resumable(cfg, inputs, {"config": meta.get("params", {}), "step": newest[0],
                                      "data_fingerprint": meta.get("data_fingerprint")}, out)
    elif list_checkpoints(out / "checkpoints"):
        names = ", ".join(p.name for p in list_checkpoints(out / "checkpoints"))
        damage, rid = run_json_damage(out), (newest[1].get("run_id") if newest else None)
        if damage and rid:  # the run's identity is lost with it: not "someone else's checkpoints"
            raise RunError(f"{out / RUN_FILE} {damage}, so opdkit cannot tell whether {names} are this run's "
                           f"(checkpoint-{newest[0]}'s opdkit.json names run_id {rid}, and there is no trainer state "
                           f"in {trainer_state.directory(out, cfg.runtime.state_dir)}); to continue that run, write "
                           f'{{"run_id": "{rid}"}} into {out / RUN_FILE}; else choose another output directory')
        raise RunError(f"{out / 'checkpoints'} holds {names} but there is no trainer state "
                       f"({trainer_state.directory(out, cfg.runtime.state_dir)}) to resume them from; choose another "
                       "output directory or remove the old checkpoints")
    elif (started := started_params(out)) is not None:
        # an earlier start that saved neither a state nor a checkpoint (killed before its first save): this start
        # begins again and takes its record (run.json's run_id, its metrics rows, the wall time it spent), so it
        # must be the same run; nothing of it was trained on, so its budget (the schedule's horizon) may change
        started = {k: v for k, v in started.items() if k != "budget"}
        try:
            check_resumable(cfg, inputs, {"config": started, "step": _run_json(out).get("step", 0)}, out)
        except RunError as e:
            record = ", ".join(n for n in ("config.yaml", "run.json", "metrics", "dvclive") if (out / n).exists())
            raise RunError(f"{e}. That start saved no trainer state and no checkpoint: to start this run there "
                           f"instead, move away its record ({record}): nothing trained is lost") from None


def _metric_lines(out: Path) -> list[tuple[str, dict]]:
    """train.jsonl's rows with their lines (none: no file), less the torn last line of a killed attempt."""
    f = out / METRICS_FILE
    if not f.exists():
        return []
    rows = []
    for line in f.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the torn last line of a killed attempt
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append((line, row))
    return rows


def elapsed_after(out: Path, step: int) -> float:
    """The largest ``elapsed_s`` of the metrics lines of steps after ``step`` (time that was spent); reads only."""
    return max((row.get("elapsed_s") or 0.0 for _, row in _metric_lines(out) if row["step"] > step), default=0.0)


def trim_metrics(out: Path, step: int) -> float:
    """Keep the metrics lines of steps <= ``step`` (a killed attempt may have written later ones, the
    last maybe half); return the largest ``elapsed_s`` among the dropped lines (time that was spent)."""
    if not (out / METRICS_FILE).exists():
        return 0.0
    rows = _metric_lines(out)
    atomic_write_text(out / METRICS_FILE, "".join(line + "\n" for line, row in rows if row["step"] <= step))
    return max((row.get("elapsed_s") or 0.0 for _, row in rows if row["step"] > step), default=0.0)


def is_published(out: Path, step: int) -> bool:
    return is_valid_checkpoint(out / "checkpoints" / f"checkpoint-{step}", full=False)[0]


def finish(out: Path, reason: str, step: int, elapsed: float, log, world: distributed.World,
           experiment_name: str, tracked: dict | None = None, record: dict | None = None) -> TrainResult:
    """run.json's record of the end (``record``: more of it, e.g. the stop rule's reserve and the saves)."""
    status = "stopped" if reason.startswith("SIG") else "completed"
    newest = newest_checkpoint(out) if world.is_main else None
    result = TrainResult(status, reason, step, round(elapsed, 3),
                         [c.name for c in list_checkpoints(out / "checkpoints")],
                         f"checkpoint-{newest[0]}" if newest else None)
    if not world.is_main:
        return result
    atomic_write_json(out / RUN_FILE, {**result.__dict__, "experiment_name": experiment_name, "run_id": run_id(out),
                                       **(record or {}), **({"tracking": tracked} if tracked else {})})
    how = f"stopped by {reason}" if status == "stopped" else f"ended ({reason})"
    log(f"training {how} at step {step} after {elapsed:.1f}s; {surviving_checkpoints_message(out / 'checkpoints')}")
    return result


@dataclass
class Start:
    """Where this start begins: the trainer state it restores (None: a fresh run), its step and data
    position, the wall time already spent; ``done``: the run had already ended (nothing to do)."""
    state: dict | None
    step: int
    data_pos: int
    elapsed0: float
    done: TrainResult | None = None
    run_id: str | None = None
    ahead: int | None = None  # the newest checkpoint's step when it is newer than ``step`` (replayed, not exported)


def begin(cfg: Config, inputs: Inputs, out: Path, log, t_start: float, world: distributed.World) -> Start:
    """Restore or start afresh: check the state again under the lock, make the ranks agree on it,
    drop the metrics lines of a killed attempt, record this start (config.yaml, run.json), and
    end at once when the run already reached its end with its checkpoint published."""
    state = trainer_state.peek(out, cfg.runtime.state_dir)  # again, now that no other run can change it
    if state is not None:
        check_resumable(cfg, inputs, state, out)
    step, data_pos = (state["step"], state["data_pos"]) if state else (0, 0)
    seen = world.gather(step if state is not None else None)  # every rank restores the same state
    if len(set(seen)) > 1:
        raise RunError("the ranks see different trainer states in "
                       f"{trainer_state.directory(out, cfg.runtime.state_dir)} (steps {seen}); with several nodes "
                       "the output directory must be one shared directory")
    lost_elapsed = elapsed_after(out, step) if world.is_main else 0.0  # those lines are dropped below
    newest = newest_checkpoint(out) if world.is_main else None
    spent = max(state["elapsed_s"] if state else 0.0, lost_elapsed,
                (newest[1].get("elapsed_s") or 0.0) if newest else 0.0)
    previous = _run_json(out) if world.is_main else {}  # before this start rewrites it
    rid = (previous.get("run_id") or (state or {}).get("run_id") or uuid.uuid4().hex) if world.is_main else None
    elapsed0, ahead, rid = world.from_main((spent, newest[0] if newest and newest[0] > step else None, rid))
    if world.is_main:
        atomic_write_text(out / "config.yaml", dump_yaml(cfg))
        atomic_write_json(out / RUN_FILE, {"status": "running", "pid": os.getpid(), "step": step, "ranks": world.size,
                                           "run_id": rid})
    log("resolved config:\n" + dump_yaml(cfg))
    start = Start(state, step, data_pos, elapsed0, run_id=rid, ahead=ahead)
    if ahead is not None:
        log(f"checkpoint-{ahead} is newer than the trainer state this start resumes from (step {step}): steps "
            f"{step + 1}..{ahead} are trained again and not exported (their checkpoints are there)")
    if state is not None or ahead is not None:
        if state is not None:
            log(f"resuming from {state['path']}: step {step}, {elapsed0:.1f}s of the wall budget already spent"
                + (f" ({lost_elapsed - state['elapsed_s']:.1f}s of it on steps after the saved state)"
                   if lost_elapsed > state["elapsed_s"] else ""))
        reason = should_stop(step, elapsed0 + time.monotonic() - t_start, 0.0, budget=cfg.budget)
        if reason is None and ended_on_the_wall_clock(previous, state, step, cfg):
            reason = "wall_clock"
        # ended already: no step fits (its budget is spent) and its newest checkpoint is published, by this state's
        # start or by a later one whose state is gone (then the steps up to it could not be replayed in the budget)
        reason, done = world.from_main((reason, bool(reason) and (ahead is not None
                                                                  or (state is not None and is_published(out, step)))))
        if done:
            if world.is_main:  # the rows of the steps its checkpoints hold stay (no step of this start replaces them)
                trim_metrics(out, ahead if ahead is not None else step)
            log(f"this run already reached its end ({reason}) and checkpoint-{ahead or step} is published: "
                "nothing to do")
            start.done = finish(out, reason, ahead or step, elapsed0 + time.monotonic() - t_start, log, world,
                                cfg.experiment_name)  # the run's end: its newest checkpoint, as its metrics rows
            return start
    if world.is_main:
        trim_metrics(out, step)  # the lines of steps after the state: this start trains them again
    return start


# --- train.jsonl's rows ------------------------------------------------------------------------


def step_row(step: int, elapsed: float, lr: float, m: dict, grad_norm: float, n_tok: float, n_seq: int, n_trunc: int,
         step_s: float, times_s: tuple[float, float, float], peak_mem_gb: float, lag: int | None, align, bad) -> dict:
    """The step's train.jsonl row: whole step, all ranks (times and memory: rank 0's / the largest);
    ``times_s``: the (rollout, score, update) seconds of the ``step_s``; ``lag``: None without
    rollout.overlap; ``bad``: the non-finite values of a skipped update. NaN / inf as null."""
    n_tok = int(n_tok)
    row = {
        "step": step, "elapsed_s": round(elapsed, 3), "lr": lr, "loss": m["loss"], "kl": m.get("kl"),
        "grad_norm": grad_norm, "response_len": n_tok / n_seq,
        "truncated_frac": n_trunc / n_seq, "tokens": n_tok,
        "tokens_per_s": n_tok / max(1e-9, step_s),
        "time_rollout_s": times_s[0], "time_score_s": times_s[1], "time_update_s": times_s[2],
        "peak_mem_gb": peak_mem_gb,
    }
    row.update({k: v for k, v in m.items() if k not in row and k not in ("tokens", "loss")})
    if lag is not None:
        row["rollout_lag"] = lag
    if align:
        row["alignment"] = align
    if bad:
        row["skipped_nonfinite"] = bad
    return finite_row(row)


def finite_row(row: dict) -> dict:
    """NaN / inf as null: train.jsonl stays strict JSON (the row says which values were non-finite)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}

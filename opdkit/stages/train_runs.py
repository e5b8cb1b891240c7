"""DVC stage ``train``: every training run of the pipeline (arm x seed), side by side.

For each arm of ``opdkit.studies.report.pipeline_arms`` (the OPD arms ``loss.name`` and
``pipeline.baseline_arm``, then the controls of ``pipeline.controls``) and each seed of
``pipeline.seeds``, one run::

    opdkit train --out OUT/<arm>/seed<n> -S seed=<n> <the arm's -S> -S experiment_name=<arm>
        -S student.path=STUDENT -S teacher.path=TEACHER -S data.train=DATA [-S rollout.offline_file=POOL]

(the last where the run has rollout.source=offline: the offline arm, ``dvc exp run -S rollout.source=offline``);

run by ``opdkit.stages.jobs``: as many at a time as the CPUs allow at ``runtime.threads`` each (one on
CUDA; ``--workers`` says otherwise), each a seeded, deterministic run whose files are the same whatever
runs beside it. A run whose command, params, inputs and code have not changed since it was made is
reused (its outputs as they are), so an experiment that changes one arm retrains that arm only:

- the params of a run: the resolved config (params < recipe < -S) without the sections ``opdkit
  train`` never reads (``TRAIN_IGNORES``) and, for the sft controls, without the OPD losses' and the
  privileged teacher's knobs (``CONTROL_IGNORES``: their command fixes the loss, its source and
  ``teacher.source=model``), so ``-S loss.clip=entry`` or ``-S teacher.source=privileged_ema`` reuses the
  controls' runs;
- the code: every opdkit source file the run's process imported.

The runs log through DVCLive (params key ``tracking``), whose logs the ``track`` stage gathers; other
trackers are refused here, before any run starts.

Each run's log is ``LOGS/<arm>-seed<n>.log``; ``OUT/jobs.json`` is the stage's ledger. Anything else in
``OUT`` (a dropped seed's or arm's runs) is removed.

    python -m opdkit.stages.train_runs --student S --teacher T --data D --out runs/train [--offline POOL]
        [--workers N] [-S k=v]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opdkit.config import ConfigError, load_config as load_as_is, to_dict
from opdkit.loss_table import samples_from
from opdkit.recipes import load_config
from opdkit.stages.jobs import Job, default_workers, run_jobs
from opdkit.studies.report import pipeline_arms
from opdkit.tracking import TrackingError, resolve as resolve_tracker

TRAIN_IGNORES = ("eval", "studies", "pipeline", "embedded")  # sections opdkit train does not read
# What the sft controls do not read: dvc.yaml's per-run train_control stages did not list these
# (tests/test_stage_jobs.py trains a control with each changed and gets the same weights)
# (nor the reward's baseline and scaling: their command sets loss.reward_weight=0)
CONTROL_IGNORES = ("teacher.ema_decay", "loss.clip_eps", "loss.dual_clip", "loss.topk", "loss.tail_bucket",
                   "loss.jsd_beta", "loss.clip", "loss.clip_tau", "loss.reward_baseline", "loss.reward_norm",
                   "rollout.offline_file", "rollout.offline_ratio")  # (and their command sets rollout.source=live)
REFERENCE_COST = 0.1  # an sft step on reference solutions (no rollout) against a sampling step: ~0.09 s vs ~1.1 s


def without(tree: dict, dotted: tuple[str, ...]) -> dict:
    """A copy of the nested dict ``tree`` without the ``dotted`` keys (sections or values)."""
    out = {}
    for k, v in tree.items():
        if k in dotted:
            continue
        inner = tuple(d[len(k) + 1:] for d in dotted if d.startswith(k + "."))
        out[k] = without(v, inner) if isinstance(v, dict) and inner else v
    return out


def train_jobs(params: str, student: str, teacher: str, data: str, out: str, logs: str,
               overrides: list[str] = (), pool: str = "") -> list[Job]:
    """The pipeline's training runs as jobs (``overrides`` apply to every run, under each arm's own). A run
    with ``rollout.source=offline`` reads the offline pool ``pool`` (``rollout.offline_file``; an input of its job)."""
    matrix = load_as_is(params, overrides)  # the arms and seeds as dvc.yaml reads them: params.yaml itself
    controls = {c.name for c in matrix.pipeline.controls}
    jobs = []
    for arm in pipeline_arms(matrix):
        ignores = TRAIN_IGNORES + (CONTROL_IGNORES if arm.name in controls else ())
        for seed in matrix.pipeline.seeds:
            run = f"{out}/{arm.name}/seed{seed}"
            sets = [*overrides, f"seed={seed}", *arm.overrides, f"experiment_name={arm.name}",
                    f"student.path={student}", f"teacher.path={teacher}", f"data.train={data}"]
            cfg = load_config(params, None, sets)  # what `opdkit train` resolves: params < recipe < -S
            if cfg.rollout.source == "offline" and pool:  # the offline arm: the pool the offline_rollouts stage drew
                sets.append(f"rollout.offline_file={pool}")
                cfg = load_config(params, None, sets)
            if resolve_tracker(cfg.tracking) != "dvclive":  # refused before hours of training, not after them
                raise ConfigError(f"params key 'tracking': the track stage (dvc.yaml) reads each run's DVCLive log, "
                                  f"so the pipeline's runs need tracking: dvclive (or auto with dvclive installed); "
                                  f"got {cfg.tracking!r}")
            view = without(to_dict(cfg), ignores)
            argv = ("train", "--out", run, "--quiet", "-p", params, *sum((["-S", s] for s in sets), []))
            cost = arm.steps * (REFERENCE_COST if samples_from(cfg.loss) == "reference" else 1.0)
            reads = (student, teacher, data) + ((cfg.rollout.offline_file,) if cfg.rollout.source == "offline" else ())
            jobs.append(Job(f"{arm.name}/seed{seed}", argv, reads, (run,), view, cost,
                            f"{logs}/{arm.name}-seed{seed}.log"))
    return jobs


def workers_for(params: str, overrides: list[str]) -> tuple[int, int]:
    """(processes, threads each): one per ``runtime.threads`` CPUs, or one on CUDA."""
    rt = load_config(params, None, list(overrides)).runtime
    if rt.device != "cpu":
        from opdkit.models import pick_device  # imports torch: only to ask whether CUDA is there

        if pick_device(rt).type == "cuda":
            return 1, rt.threads
    return default_workers(rt.threads), rt.threads


def add_job_options(ap: argparse.ArgumentParser, logs: str) -> None:
    """The options the train and eval stages share: their logs' folder (default ``logs``), the processes at a
    time, the params file and its -S overrides."""
    ap.add_argument("--logs", default=logs, help=f"one log per job (default {logs})")
    ap.add_argument("--workers", type=int, default=0, help="processes at a time (default: one per CPU / "
                    "runtime.threads; one on CUDA)")
    ap.add_argument("-p", "--params", default="params.yaml")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opdkit.stages.train_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--student", required=True)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--data", required=True, help="the train table (parquet/jsonl)")
    ap.add_argument("--out", required=True, help="the runs' folder: OUT/<arm>/seed<n>, and the ledger OUT/jobs.json")
    ap.add_argument("--offline", default="", metavar="POOL", help="the offline pool (opdkit offline-rollouts): "
                    "runs with rollout.source=offline read it (rollout.offline_file)")
    add_job_options(ap, "runs/logs/train")
    args = ap.parse_args(argv)
    try:
        jobs = train_jobs(args.params, args.student, args.teacher, args.data, args.out, args.logs, args.overrides,
                          args.offline)
        workers, threads = workers_for(args.params, args.overrides)
    except (ConfigError, TrackingError) as e:
        print(f"opdkit.stages.train_runs: error: {e}", file=sys.stderr)
        return 2
    return run_jobs(jobs, Path(args.out) / "jobs.json", args.workers or workers, threads, roots=[args.out])


if __name__ == "__main__":
    raise SystemExit(main())

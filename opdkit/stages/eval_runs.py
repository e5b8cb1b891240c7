"""DVC stage ``eval``: every evaluation of the pipeline, side by side.

The jobs, one ``opdkit eval`` each, run by ``opdkit.stages.jobs`` (as many at a time as the CPUs
allow; a worker process evaluates one checkpoint after another, so its start-up is paid once):

- the student before training and the teacher: ``OUT/reference/before.json`` and ``teacher.json``
  (tagged ``arm=before`` / ``arm=teacher``);
- every kept checkpoint of each run of the train matrix (``opdkit.studies.report.pipeline_matrix``,
  ``RUNS/<arm>/seed<n>``, whose last checkpoint must be ``checkpoint-<the arm's steps>``), with the
  command ``opdkit.stages.eval_checkpoints`` runs for it: the last into ``OUT/<arm>/seed<n>.json``, the others
  into ``CURVES/<arm>/seed<n>/checkpoint-<step>.json``, tagged ``step``, ``arm``, ``seed`` and ``match``
  (``steps`` for the OPD arms, the control's own for a control).

Then each run's ``CURVES/<arm>/seed<n>/curve.json`` (``opdkit.stages.eval_checkpoints.write_curve``). An
eval whose command, eval params, checkpoint, data and code are unchanged is reused; ``OUT/jobs.json``
is the ledger; anything else in ``OUT`` and ``CURVES`` is removed.

    python -m opdkit.stages.eval_runs --runs runs/train --student S --teacher T --data D --out runs/eval \
        --curves runs/curves [--workers N] [-S k=v]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opdkit.config import ConfigError, load_config as load_as_is, to_dict
from opdkit.persist.fsutil import step_of
from opdkit.recipes import load_config
from opdkit.stages.eval_checkpoints import check_last_step, eval_argv, eval_out, write_curve
from opdkit.stages.jobs import Job, run_jobs
from opdkit.stages.train_runs import add_job_options, workers_for
from opdkit.studies.report import pipeline_arms

EVAL_READS = ("eval", "data", "runtime")  # the params sections opdkit eval reads


def _job(name: str, argv: list[str], model: str, data: str, out: Path, view: dict, logs: str) -> Job:
    return Job(name, tuple(argv), (model, data), (str(out), str(out.with_suffix(".jsonl"))), view, 1.0,
               f"{logs}/{name.replace('/', '-')}.log")


def eval_jobs(params: str, runs: str, student: str, teacher: str, data: str, out: str, curves: str, logs: str,
              overrides: list[str] = ()) -> tuple[list[Job], list[tuple[Path, Path, dict, list]]]:
    """The jobs, and per training run (run dir, curve dir, tags, [(step, eval JSON)]) for its curve.
    Raises ``ValueError`` when a run's last checkpoint is not the arm's step budget."""
    matrix = load_as_is(params, overrides)
    cfg = load_config(params, None, list(overrides))  # what `opdkit eval` resolves: params < recipe < -S
    view = {k: v for k, v in to_dict(cfg).items() if k in EVAL_READS}
    common = ["-p", params, *sum((["-S", s] for s in overrides), [])]
    jobs = [_job(f"reference/{arm}", ["eval", "--model", model, "--data", data, "--out", f"{out}/reference/{arm}.json",
                                      "--quiet", "--tag", f"arm={arm}", *common],
                 model, data, Path(out) / "reference" / f"{arm}.json", view, logs)
            for arm, model in (("before", student), ("teacher", teacher))]
    curves_todo = []
    for arm in pipeline_arms(matrix):
        for seed in matrix.pipeline.seeds:
            run, curve_dir = Path(runs) / arm.name / f"seed{seed}", Path(curves) / arm.name / f"seed{seed}"
            tags = {"arm": arm.name, "seed": str(seed), "match": "steps" if arm.match == "baseline" else arm.match}
            evaluated = []
            for ck in check_last_step(run, arm.steps):
                dest = eval_out(ck, arm.steps, Path(out) / arm.name / f"seed{seed}.json", curve_dir)
                argv = eval_argv(ck, dest, data, [f"{k}={v}" for k, v in tags.items()], params, list(overrides))
                jobs.append(_job(f"{arm.name}/seed{seed}/{ck.name}", argv, str(ck), data, dest, view, logs))
                evaluated.append((step_of(ck), dest))
            curves_todo.append((run, curve_dir, tags, evaluated))
    return jobs, curves_todo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opdkit.stages.eval_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="the train stage's folder of runs (RUNS/<arm>/seed<n>)")
    ap.add_argument("--student", required=True, help="the model before training")
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--data", required=True, help="the eval table (parquet/jsonl)")
    ap.add_argument("--out", required=True, help="eval JSONs: OUT/reference/*.json, OUT/<arm>/seed<n>.json; the "
                    "ledger OUT/jobs.json")
    ap.add_argument("--curves", required=True, help="the learning curves: CURVES/<arm>/seed<n>/")
    add_job_options(ap, "runs/logs/eval")
    args = ap.parse_args(argv)
    try:
        jobs, curves = eval_jobs(args.params, args.runs, args.student, args.teacher, args.data, args.out,
                                 args.curves, args.logs, args.overrides)
        workers, threads = workers_for(args.params, args.overrides)
    except (ConfigError, ValueError) as e:
        print(f"opdkit.stages.eval_runs: error: {e}", file=sys.stderr)
        return 2
    keep = [curve_dir / "curve.json" for _, curve_dir, _, _ in curves]
    status = run_jobs(jobs, Path(args.out) / "jobs.json", args.workers or workers, threads,
                      roots=[args.out, args.curves], keep=keep)
    if status:
        return status
    for run, curve_dir, tags, evaluated in curves:
        write_curve(run, curve_dir, tags, evaluated)
    print(f"wrote {len(jobs)} evals into {args.out} and {len(curves)} learning curves into {args.curves}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

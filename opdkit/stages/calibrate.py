"""Calibrate the pipeline's matched-wall-clock step budgets: seconds per training step of each arm.

Trains each arm of ``opdkit.studies.report.pipeline_arms`` (the params as dvc.yaml reads them, plus -S) for
``--steps`` steps from the pipeline's student, publishing off, into a temporary directory, and takes the
median of its per-step seconds after ``--skip`` warm-up steps (``elapsed_s`` differences of
``metrics/train.jsonl``: the whole step, rollout + scoring + update). The baseline arm's budget,
``budget.max_steps x s_baseline``, is the wall clock every ``match: wall`` control gets:
``steps = round(budget.max_steps * s_baseline / s_arm)``, with ``every_steps`` keeping the baseline's
number of learning-curve checkpoints. Prints the ``pipeline.controls`` block for params.yaml, the
training seconds ``dvc repro`` will spend (steps x seconds per step, summed over arms and seeds; start-up,
evals, studies and notebooks come on top) and the train stage's wall clock when its runs go side by side
on this machine's processes (``opdkit.stages.train_runs``: longest first, each on a CPU of its own, as
if they did not slow each other). Timings are only valid on an otherwise idle machine; the arms train
one after another, each in a fresh process set up as the train stage's workers are (spawned,
``OMP_NUM_THREADS`` = ``runtime.threads``, ``OMP_WAIT_POLICY=PASSIVE``), so the per-step figures are each
arm's alone and as the pipeline runs it: in one process, an arm trained after another measured up to 1.5x
slower (sft_teacher 0.868 s/step after rkl, 0.55-0.63 in the pipeline's processes, 2026-12-02).

    python -m opdkit.stages.calibrate [--steps 30] [-S runtime.threads=1 ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import statistics
import tempfile
from dataclasses import replace as dc_replace
from pathlib import Path

import yaml

from opdkit.config import load_config as load_as_is, replace, to_dict
from opdkit.recipes import load_config
from opdkit.stages.jobs import default_workers, init_worker
from opdkit.studies.report import pipeline_arms, read_jsonl


def seconds_per_step(metrics: list[dict], skip: int) -> float:
    """Median seconds of the steps after the first ``skip`` (``elapsed_s`` differences of the rows)."""
    elapsed = [r["elapsed_s"] for r in metrics]
    steps = [b - a for a, b in zip(elapsed, elapsed[1:])][skip:]
    if not steps:
        raise ValueError(f"calibrate: {len(metrics)} steps leave none after {skip} warm-up steps; raise --steps")
    return statistics.median(steps)


def _time_arm(cfg, out: Path, skip: int) -> float:
    """Seconds per step of one arm trained into ``out`` (runs in a worker process of its own)."""
    from opdkit.train import train  # imports torch: in the worker, after its environment is set

    train(cfg, out, log=lambda *a: None, progress=False)
    return seconds_per_step(read_jsonl(out / "metrics" / "train.jsonl"), skip)


def wall_matched(cfg, s_baseline: float, s_arm: float, every_points: int) -> tuple[int, int]:
    """(steps, every_steps) of a control that trains as long as the baseline's budget.max_steps."""
    steps = max(1, round(cfg.budget.max_steps * s_baseline / s_arm))
    return steps, max(1, -(-steps // every_points))  # ceil: at most every_points checkpoints


def stage_seconds(run_seconds: list[float], workers: int) -> float:
    """Wall clock of runs of ``run_seconds`` on ``workers`` processes, started longest first, each
    taking the first free process (the train stage's order)."""
    free = [0.0] * max(1, workers)
    for s in sorted(run_seconds, reverse=True):
        i = free.index(min(free))
        free[i] += s
    return max(free)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opdkit.stages.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps per arm (default 30)")
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median (default 5)")
    ap.add_argument("-p", "--params", default="params.yaml")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    matrix = load_as_is(args.params, args.overrides)  # the arms as dvc.yaml reads them
    base_cfg = load_config(args.params, None, args.overrides)  # what a train stage runs: params < recipe < -S
    arms = pipeline_arms(matrix)
    timing = {}
    with tempfile.TemporaryDirectory(prefix="opdkit-calibrate-") as tmp:
        for arm in arms:
            cfg = replace(base_cfg, *arm.overrides, f"budget.max_steps={args.steps}", "budget.max_wall_time_s=0",
                          "publish.every_steps=0", "runtime.alignment_check=false")
            with cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=init_worker,
                                        initargs=(base_cfg.runtime.threads,)) as pool:  # a fresh process per arm
                timing[arm.name] = pool.submit(_time_arm, cfg, Path(tmp) / arm.name, args.skip).result()
            print(f"{arm.name}: {timing[arm.name]:.4f} s/step")
    s_base = timing[matrix.pipeline.baseline_arm]
    every_points = max(1, matrix.budget.max_steps // max(1, matrix.publish.every_steps))
    controls = []
    for c in matrix.pipeline.controls:
        if c.match == "wall":
            steps, every = wall_matched(matrix, s_base, timing[c.name], every_points)
            c = dc_replace(c, steps=steps, every_steps=every)
        controls.append(c)
    seeds = len(matrix.pipeline.seeds)
    steps_of = {a.name: a.steps for a in arms} | {c.name: c.steps for c in controls}
    train_s = {name: steps_of[name] * timing[name] * seeds for name in timing}
    workers = default_workers(base_cfg.runtime.threads)
    runs = [steps_of[name] * timing[name] for name in timing for _ in range(seeds)]
    result = {"seconds_per_step": timing, "baseline_budget_s": matrix.budget.max_steps * s_base,
              "train_seconds_per_arm": train_s, "train_seconds_total": sum(train_s.values()),
              "train_stage_s": {"workers": workers, "seconds": round(stage_seconds(runs, workers), 1)},
              "calibration": {"steps": args.steps, "skip": args.skip, "threads": base_cfg.runtime.threads}}
    print(json.dumps(result, indent=2))
    print("# params.yaml, pipeline section:")
    print(yaml.safe_dump({"controls": to_dict(controls)}, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

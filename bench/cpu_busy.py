"""CPU step time of `opdkit train` on the embedded default, idle and beside busy processes.

    python bench/cpu_busy.py --out DIR [--steps 12] [--busy 0 1] [--threads 2 1] [--wait-policy unset ACTIVE PASSIVE]
        [--arms rkl sft_teacher sft_reference]

For each combination of threads (``runtime.threads``), OpenMP wait policy (``OMP_WAIT_POLICY`` in
the trainer's environment; ``unset`` leaves it out: libgomp's spin-then-sleep default before
issue 15, PASSIVE since, as opdkit's command line sets it; ``SPIN<n>``: ``GOMP_SPINCOUNT=n``, spin
briefly then sleep) and number of busy processes (pure-Python spin loops, one core each), runs
``python -m opdkit train`` for ``--steps`` steps of the default rollout (16 prompts x 4 samples,
64 tokens) and reads the step times from its ``metrics/train.jsonl``
(``time_rollout_s + time_score_s + time_update_s``; the first two steps are dropped as warm-up),
for each arm of ``--arms`` (the pipeline's arms, ``opdkit.studies.report.pipeline_arms``: default ``rkl``;
the controls train as the pipeline trains them).
Prints one line per case, with the median seconds of each phase, and writes DIR/cpu_busy.json:

    arm  threads policy  busy  median_step_s  steps_per_s  min_step_s  max_step_s  rollout  score  update

Before / after a change of the code: the same command with ``PYTHONPATH`` at each checkout.

Timings are only meaningful on a machine where nothing else runs (the busy processes are the only
intended load); run it once before and once after a change and compare the lines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

SPIN = "while True: pass"


def one_case(out: Path, steps: int, threads: int, policy: str, busy: int, arm: str = "rkl",
             arm_overrides: tuple[str, ...] = ()) -> dict:
    run_dir = out / f"{arm}-t{threads}-{policy.lower()}-busy{busy}"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")}
    env.pop("GOMP_SPINCOUNT", None)
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if policy.startswith("SPIN"):  # spin this many times, then sleep (libgomp); the wait policy left unset
        env.update(GOMP_SPINCOUNT=policy[4:], OMP_WAIT_POLICY="")
    elif policy != "unset":
        env["OMP_WAIT_POLICY"] = policy
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    try:
        cmd = [sys.executable, "-m", "opdkit", "train", "--out", str(run_dir), "-p", "none", "--quiet",
               "-S", f"runtime.threads={threads}", "-S", f"budget.max_steps={steps}", "-S", "budget.max_wall_time_s=0",
               "-S", "optim.schedule=constant", "-S", "publish.every_steps=0",
               *sum((["-S", o] for o in arm_overrides if not o.startswith(("budget.", "publish."))), [])]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    rows = [json.loads(ln) for ln in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    times = [r["time_rollout_s"] + r["time_score_s"] + r["time_update_s"] for r in rows[2:]]
    med = statistics.median(times)
    phases = {k: round(statistics.median(r[f"time_{k}_s"] for r in rows[2:]), 3)
              for k in ("rollout", "score", "update")}
    return {"arm": arm, **phases, "threads": threads, "policy": policy, "busy": busy, "median_step_s": round(med, 3),
            "steps_per_s": round(1 / med, 3), "min_step_s": round(min(times), 3), "max_step_s": round(max(times), 3),
            "n_steps": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--wait-policy", nargs="+", default=["unset"], help="unset | ACTIVE | PASSIVE | SPIN<n>")
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--arms", nargs="+", default=["rkl"],
                    help="arms of the pipeline (opdkit.studies.report.pipeline_arms)")
    args = ap.parse_args()
    from opdkit.config import load_config
    from opdkit.studies.report import pipeline_arms

    arms = {a.name: a.overrides for a in pipeline_arms(load_config(None))}
    unknown = [a for a in args.arms if a not in arms]
    if unknown:
        ap.error(f"--arms {unknown}: the pipeline's arms are {', '.join(arms)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    print(f"{'arm':<14} {'threads':>7} {'policy':>8} {'busy':>4} {'median_step_s':>13} {'steps_per_s':>11} {'min':>6} "
          f"{'max':>6} {'rollout':>7} {'score':>6} {'update':>6}")
    for arm, threads, policy, busy in itertools.product(args.arms, args.threads, args.wait_policy, args.busy):
        r = one_case(out, args.steps, threads, policy, busy, arm, arms[arm])
        results.append(r)
        print(f"{arm:<14} {threads:>7} {policy:>8} {busy:>4} {r['median_step_s']:>13.3f} {r['steps_per_s']:>11.3f} "
              f"{r['min_step_s']:>6.2f} {r['max_step_s']:>6.2f} {r['rollout']:>7.3f} {r['score']:>6.3f} "
              f"{r['update']:>6.3f}",
              flush=True)
    (out / "cpu_busy.json").write_text(json.dumps({"cpus": os.cpu_count(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()

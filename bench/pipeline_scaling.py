"""Wall clock of the pipeline's train and eval stages against the number of worker processes (no DVC).

    python bench/pipeline_scaling.py --out DIR --workers 1 2 8 16 [-S key=value ...]

For each N of ``--workers``, in a fresh folder ``DIR/w<N>``: the embedded task and models (``opdkit
embedded``) and the data subset (``opdkit.stages.subset``), then the two stages' commands exactly as
dvc.yaml runs them (``python -m opdkit.stages.train_runs``, then ``opdkit.stages.eval_runs``) with
``--workers N``, each timed. The params are this repository's ``params.yaml`` (the whole study: 3 arms x
3 seeds x 120 steps, every kept checkpoint evaluated) plus ``-S runtime.device=cpu`` (the CPU even where
a GPU is) and any ``-S``. Prints one line per N and writes ``DIR/pipeline_scaling.json``: per N the
stages' seconds, and per arm the median seconds per training step over its runs (``elapsed_s``
differences of ``metrics/train.jsonl``, the first 5 steps left out).

Timings are only meaningful on a machine where nothing else runs. A dry run at tiny settings:

    python bench/pipeline_scaling.py --out /tmp/ps --workers 1 2 -S budget.max_steps=3 \\
        -S rollout.prompts_per_step=2 -S rollout.max_new_tokens=16 -S publish.every_steps=2 -S eval.max_questions=6 \\
        -S 'pipeline.controls=[{name: sft_reference, sft_source: reference, steps: 4, every_steps: 2, match: steps}]'
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], log: Path, env: dict) -> float:
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return time.monotonic() - t0


def step_seconds(train_dir: Path, skip: int = 5) -> dict[str, float]:
    """Per arm: the median step time over all its runs' steps after the first ``skip``."""
    out = {}
    for arm in sorted(p for p in train_dir.iterdir() if p.is_dir()):
        steps = []
        for run in sorted(arm.glob("seed*")):
            rows = [json.loads(ln) for ln in (run / "metrics" / "train.jsonl").read_text().splitlines()]
            e = [r["elapsed_s"] for r in rows]
            steps += [b - a for a, b in zip(e, e[1:])][skip:]
        if steps:
            out[arm.name] = round(statistics.median(steps), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("-p", "--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    sets = sum((["-S", s] for s in ["runtime.device=cpu", *args.overrides]), [])
    py = [sys.executable]
    import torch  # only for the record of the machine

    results = []
    print(f"{'workers':>7} {'train_s':>8} {'eval_s':>7} {'total_s':>8}  s/step per arm")
    for n in args.workers:
        d = out / f"w{n}"
        shutil.rmtree(d, ignore_errors=True)
        (d / "logs").mkdir(parents=True)
        emb, data = d / "embedded", d / "data"
        timed(py + ["-m", "opdkit", "embedded", "--out", str(emb)], d / "logs" / "embedded.log", env)
        timed(py + ["-m", "opdkit.stages.subset", "--train", str(emb / "data" / "train.parquet"), "--eval",
                    str(emb / "data" / "eval.parquet"), "--out-train", str(data / "train.parquet"), "--out-eval",
                    str(data / "eval.parquet"), "--info", str(data / "subset.json"), "-p", args.params, *sets],
              d / "logs" / "subset.log", env)
        common = ["--student", str(emb / "student"), "--teacher", str(emb / "teacher"), "--workers", str(n),
                  "-p", args.params, *sets]
        train_s = timed(py + ["-m", "opdkit.stages.train_runs", "--out", str(d / "train"), "--data",
                              str(data / "train.parquet"), "--logs", str(d / "logs" / "train"), *common],
                        d / "logs" / "train_stage.log", env)
        eval_s = timed(py + ["-m", "opdkit.stages.eval_runs", "--runs", str(d / "train"), "--out", str(d / "eval"),
                             "--curves", str(d / "curves"), "--data", str(data / "eval.parquet"), "--logs",
                             str(d / "logs" / "eval"), *common], d / "logs" / "eval_stage.log", env)
        per_step = step_seconds(d / "train")
        results.append({"workers": n, "train_s": round(train_s, 1), "eval_s": round(eval_s, 1),
                        "total_s": round(train_s + eval_s, 1), "s_per_step": per_step})
        print(f"{n:>7} {train_s:>8.1f} {eval_s:>7.1f} {train_s + eval_s:>8.1f}  "
              + ", ".join(f"{k} {v:.3f}" for k, v in per_step.items()), flush=True)
    model = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
             if ln.startswith("model name")] if Path("/proc/cpuinfo").is_file() else []
    machine = {"cpus": len(os.sched_getaffinity(0)), "cpu": model[0] if model else platform.machine(),
               "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "python": platform.python_version(), "overrides": args.overrides}
    (out / "pipeline_scaling.json").write_text(json.dumps({"machine": machine, "results": results}, indent=2) + "\n")
    print(f"wrote {out / 'pipeline_scaling.json'}")


if __name__ == "__main__":
    main()

"""Issue 17's grid: which embedded task gives on-policy distillation room to win?

Builds each variant of the embedded task (``embedded.*`` overrides of params.yaml), evaluates its
student and teacher, trains every arm x seed from its student with the pipeline's settings (params.yaml,
plus -S), evaluates every kept checkpoint (``opdkit.stages.eval_checkpoints``) and writes one table: per variant
and arm, accuracy mean +- se over seeds (and the mean clustered se of one run), and the best OPD arm's
difference against ``sft_teacher`` in combined standard errors. Jobs run in parallel processes (each one
thread); run lengths are step counts, so the numbers do not depend on the parallelism.

    python bench/embedded_grid.py --out /tmp/grid --device cuda --jobs 14 [--variants a,b] [-S key=value ...]

On a CUDA device the variants are built on the GPU (``build(..., device="cuda")``: not the CPU bits of
the shipped assets, the same recipe) and train and evaluate in float32 there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from opdkit.stats import compare_arms, repeat_stats

SMALL = {"embedded.student_hidden_size": 64, "embedded.student_layers": 2, "embedded.student_heads": 2,
         "embedded.student_intermediate_size": 256, "embedded.student_init": "scratch",
         "embedded.student_base_steps": 1200}
VARIANTS = {  # name: embedded.* overrides ("shipped": the shipped build, copied by `opdkit embedded`)
    "shipped": {},
    "same_planted": {},  # the shipped recipe: the teacher's shape from its run at step 500, carries dropped
    "small_planted": SMALL,
    "small_clean": SMALL | {"embedded.student_carry_steps": 0},
    "small_planted_ops4": SMALL | {"embedded.n_ops": 4},
    "small_clean_ops4": SMALL | {"embedded.n_ops": 4, "embedded.student_carry_steps": 0},
    "same_planted_ops4": {"embedded.n_ops": 4},
    "mid_planted": SMALL | {"embedded.student_hidden_size": 96, "embedded.student_layers": 3,
                            "embedded.student_heads": 4, "embedded.student_intermediate_size": 384},
}
ARMS = {  # name: train overrides (the pipeline's OPD arm and its controls)
    "rkl": ["loss.name=rkl"],
    "k1": ["loss.name=k1"],
    "jsd": ["loss.name=jsd"],
    "sft_teacher": ["loss.name=sft", "loss.sft_source=teacher", "teacher.source=model"],
    "sft_reference": ["loss.name=sft", "loss.sft_source=reference", "teacher.source=model"],
    # issue 26: one-step-off rollouts (rollout.overlap=1) against the on-policy arms above
    "rkl_overlap": ["loss.name=rkl", "rollout.overlap=1"],
    "k1_overlap": ["loss.name=k1", "rollout.overlap=1"],
}
OPD_ARMS = ("rkl", "k1", "jsd")


def run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc:
        raise RuntimeError(f"rc {rc} after {time.time() - t0:.0f}s: {' '.join(cmd)} (log {log})")


def build(out: Path, name: str, device: str, params: str, extra: list[str]) -> None:
    if (out / name / "embedded" / "student" / "model.safetensors").exists():
        return
    if name == "shipped":
        run(["opdkit", "embedded", "--out", str(out / name / "embedded")], out / name / "build.log")
        return
    sets = [f"{k}={v}" for k, v in VARIANTS[name].items()] + extra
    code = ("import json, sys; from pathlib import Path; from opdkit.recipes import load_config; "
            "from opdkit.embedded.build import build; from opdkit.embedded import write_manifest; "
            "from opdkit.config import to_dict; "
            f"cfg = load_config({params!r}, None, {sets!r}); out = Path({str(out / name / 'embedded')!r}); "
            f"made = build(out, cfg.embedded, device={device!r}); write_manifest(out, to_dict(cfg.embedded), made)")
    run([sys.executable, "-c", code], out / name / "build.log")


def common(args) -> list[str]:
    sets = ["runtime.threads=1", f"runtime.device={args.device}", "runtime.dtype=float32", *args.overrides]
    return ["-p", args.params, *sum((["-S", s] for s in sets), [])]


def evaluate(out: Path, name: str, model: str, args) -> None:
    dest = out / name / "eval" / "reference" / f"{model}.json"
    if not dest.exists():
        run(["opdkit", "eval", "--model", str(out / name / "embedded" / model),
             "--data", str(out / name / "embedded" / "data" / "eval.parquet"), "--out", str(dest), "--quiet",
             *common(args)], dest.with_suffix(".log"))


def train_and_eval(out: Path, name: str, arm: str, seed: int, args) -> None:
    run_dir = out / name / "train" / arm / f"seed{seed}"
    dest = out / name / "eval" / arm / f"seed{seed}.json"
    if dest.exists():
        return
    emb = out / name / "embedded"
    sets = [*ARMS[arm], f"seed={seed}", f"student.path={emb / 'student'}", f"teacher.path={emb / 'teacher'}",
            f"data.train={emb / 'data' / 'train.parquet'}", f"budget.max_steps={args.steps}",
            f"publish.every_steps={args.every}", f"publish.keep={max(1, args.steps // args.every)}"]
    run(["opdkit", "train", "--out", str(run_dir), *common(args), *sum((["-S", s] for s in sets), [])],
        run_dir.with_suffix(".log"))
    run([sys.executable, "-m", "opdkit.stages.eval_checkpoints", "--run", str(run_dir), "--steps", str(args.steps),
         "--data", str(emb / "data" / "eval.parquet"), "--out", str(dest),
         "--curve-dir", str(out / name / "curves" / arm / f"seed{seed}"), "--tag", f"arm={arm}",
         "--tag", f"seed={seed}", *common(args)], dest.with_suffix(".log"))


def table(out: Path, args) -> dict:
    result = {}
    for name in args.variants:
        ref = {m: json.loads((out / name / "eval" / "reference" / f"{m}.json").read_text())
               for m in ("student", "teacher") if (out / name / "eval" / "reference" / f"{m}.json").exists()}
        v = {"overrides": VARIANTS[name], **{m: [r["accuracy"], r["stderr"]] for m, r in ref.items()}, "arms": {}}
        for arm in args.arms:
            accs = {}
            for seed in args.seeds:
                f = out / name / "eval" / arm / f"seed{seed}.json"
                if f.exists():
                    accs[seed] = json.loads(f.read_text())
            if not accs:
                continue
            st = repeat_stats([a["accuracy"] for a in accs.values()])
            m, se = st["mean"], st["se"]
            curve = {}
            for seed in accs:
                c = out / name / "curves" / arm / f"seed{seed}" / "curve.json"
                if c.exists():
                    for p in json.loads(c.read_text())["points"]:
                        curve.setdefault(p["step"], []).append(p["accuracy"])
            kl = {}  # the true per-token KL estimate (train.jsonl's kl), mean of each run's last 10 steps
            for seed in accs:
                f = out / name / "train" / arm / f"seed{seed}" / "metrics" / "train.jsonl"
                ks = [json.loads(ln).get("kl") for ln in f.read_text().splitlines()][-10:] if f.exists() else []
                if ks and None not in ks:
                    kl[seed] = sum(ks) / len(ks)
            kst = repeat_stats(list(kl.values())) if kl else {"mean": None, "se": None}
            v["arms"][arm] = {"accuracy": {s: a["accuracy"] for s, a in accs.items()}, "mean": m, "se_seeds": se,
                              "final_kl": kl, "final_kl_mean": kst["mean"], "final_kl_se": kst["se"],
                              "mean_clustered_se": sum(a["stderr"] for a in accs.values()) / len(accs),
                              "curve_mean": {s: sum(x) / len(x) for s, x in sorted(curve.items())}}
        opd = [a for a in OPD_ARMS if a in v["arms"]]
        if opd and "sft_teacher" in v["arms"]:
            best = max(opd, key=lambda a: v["arms"][a]["mean"])
            a, b = v["arms"][best], v["arms"]["sft_teacher"]
            if len(a["accuracy"]) > 1 and len(b["accuracy"]) > 1:  # Welch: se = sqrt(se_a^2 + se_b^2)
                c = compare_arms(list(a["accuracy"].values()), list(b["accuracy"].values()))
                v["best_opd_vs_sft_teacher"] = {"arm": best, "diff": c["diff"], "combined_se": c["se"],
                                                "z": c["diff_in_se"], "welch_p": c["p_value"]}
        result[name] = v
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--arms", default="rkl,sft_teacher,sft_reference")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=60)
    ap.add_argument("-p", "--params", default="params.yaml")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[])
    ap.add_argument("-B", "--build-set", dest="build_overrides", action="append", default=[],
                    help="embedded.* overrides on top of every variant's (a quick trial)")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    args.variants, args.arms = args.variants.split(","), [a for a in args.arms.split(",") if a]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    if not args.table_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(build, out, n, args.device, args.params, args.build_overrides)
                       for n in args.variants]
            errors = [f.exception() for f in futures]
            print(f"built {args.variants} in {time.time() - t0:.0f}s; errors {[str(e) for e in errors if e]}",
                  flush=True)
            ok = [n for n, e in zip(args.variants, errors) if e is None]
            jobs = [pool.submit(evaluate, out, n, m, args) for n in ok for m in ("student", "teacher")]
            jobs += [pool.submit(train_and_eval, out, n, a, s, args) for s in args.seeds for n in ok for a in args.arms]
            for f in jobs:
                if f.exception():
                    print(f"error: {f.exception()}", flush=True)
    result = table(out, args)
    (out / "grid.json").write_text(json.dumps(result, indent=1) + "\n")
    for name, v in result.items():
        print(f"{name}: student {v.get('student')} teacher {v.get('teacher')}")
        for arm, a in v["arms"].items():
            print(f"  {arm:14s} {a['mean']:.3f} +- {a['se_seeds']:.3f} (seeds {list(a['accuracy'].values())}; "
                  f"run se {a['mean_clustered_se']:.3f}) final kl {a['final_kl_mean']} +- {a['final_kl_se']} "
                  f"curve {a['curve_mean']}")
        if "best_opd_vs_sft_teacher" in v:
            print(f"  best OPD vs sft_teacher: {v['best_opd_vs_sft_teacher']}")
    print(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

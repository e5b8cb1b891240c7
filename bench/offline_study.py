"""The teacher-consistency study (issue 35; docs/offline_opd.md): does offline OPD match online OPD when
the starting student was SFT'd on the teacher's own samples, and fall behind when it was SFT'd on another
source (Lightning OPD, arXiv 2604.13010)?

On the embedded default, from the shipped student:

1. SFT (``loss.name=sft``, ``--sft-steps`` steps, seed 0) on each source:
   - ``teacher``: the teacher's samples (``loss.sft_source=teacher``: drawn live at temperature 1; this
     teacher's samples are the reference solutions token for token, docs/offline_opd.md);
   - ``carry``: a second teacher, the task's writer with every addition's carries dropped (the
     embedded student's planted error, ``opdkit.embedded.task.carry_dropped_solution``), as
     ``loss.sft_source=reference`` on a copy of the training rows holding its solutions.
2. Each SFT'd student's pool: ``opdkit offline-rollouts --policy SFT`` (the prompts of ``--steps`` steps of
   seed 0, 4 samples each, scored by the teacher).
3. OPD with k1 from each SFT'd student, ``--steps`` steps, each seed: ``online`` (the student's own
   rollouts, scored live), ``offline`` (the pool, ``rollout.offline_ratio=behaviour``) and ``offline_none``
   (the pool, ratio 1).
4. Every run's checkpoints (each ``--every`` steps) evaluated with ``opdkit eval`` (the pipeline's
   protocol), the SFT'd students too; ``opdkit report`` per source against its online arm.

Jobs run side by side (``opdkit.stages.jobs``: one process per ``--workers``, one thread each; a job whose
command, params, inputs and code are unchanged is reused). Writes OUT/... and the summary
``--results`` (JSON: per arm mean +- se over seeds, the report's comparisons, training seconds, the
pools' seconds, the learning curves, the commands).

    python bench/offline_study.py --out runs/offline_study --results bench/results/offline [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from scipy.stats import ttest_rel

from opdkit.data import read_table, write_rows
from opdkit.embedded import asset
from opdkit.embedded.task import carry_dropped_solution, parse_prompt
from opdkit.offline import read_meta
from opdkit.stages.jobs import Job, run_jobs
from opdkit.stats import repeat_stats
from opdkit.studies.report import report

SOURCES = {"teacher": ["loss.sft_source=teacher"], "carry": ["loss.sft_source=reference"]}
MODES = {"online": [], "offline": ["rollout.source=offline", "rollout.offline_ratio=behaviour"],
         "offline_none": ["rollout.source=offline", "rollout.offline_ratio=none"]}
COMMON = ["runtime.threads=1", "tracking=none", "budget.max_wall_time_s=0"]


def carry_rows(out: Path) -> Path:
    """The embedded training rows with the carry-dropping writer's solutions (deterministic)."""
    path = out / "data" / "carry.parquet"
    if not path.is_file():
        rows = [r | {"solution": carry_dropped_solution(parse_prompt(r["prompt"]))} for r in read_table(asset("train"))]
        write_rows(rows, path)
    return path


def gap_difference(a: dict, b: dict) -> dict:
    """Per-seed differences a[s] - b[s] over the common seeds: mean, se (sd / sqrt(n)), t = mean / se and its
    two-sided p (scipy's paired t-test, n - 1 degrees of freedom)."""
    seeds = [s for s in a if s in b]
    d = [a[s] - b[s] for s in seeds]
    st = repeat_stats(d)
    t = ttest_rel([a[s] for s in seeds], [b[s] for s in seeds])
    return {"diff": st["mean"], "se": st["se"], "diff_in_se": float(t.statistic), "p_value": float(t.pvalue),
            "df": len(seeds) - 1, "seeds": seeds}


def step_phases(run_dirs: list[Path]) -> dict:
    """Median seconds per step of each phase (train.jsonl's time_rollout_s / time_score_s / time_update_s) and
    of the whole step, over the steps of ``run_dirs`` (step 1, with start-up work, left out)."""
    rows = [json.loads(ln) for d in run_dirs for ln in (d / "metrics" / "train.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 1]
    keys = {"rollout": "time_rollout_s", "score": "time_score_s", "update": "time_update_s"}
    out = {k: statistics.median(r[v] for r in rows) for k, v in keys.items()}
    out["step"] = statistics.median(r["time_rollout_s"] + r["time_score_s"] + r["time_update_s"] for r in rows)
    return {k: round(v, 4) for k, v in out.items()}


def params_args(params: str, sets: list[str]) -> tuple[str, ...]:
    return ("-p", params, "--quiet", *sum((["-S", s] for s in [*COMMON, *sets]), []))


def phase(name: str, jobs: list[Job], out: Path, workers: int, skip: bool = False) -> None:
    if skip:
        return
    if run_jobs(jobs, out / "ledgers" / f"{name}.json", workers, 1, roots=[out / name]) != 0:
        sys.exit(f"bench/offline_study.py: phase {name} failed (the logs under {out / 'logs'} say why)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/offline_study")
    ap.add_argument("--results", default="bench/results/offline")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=40)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--variant", default="", help="a named variant of the OPD runs (with --opd-set): its runs and "
                    "evals under OUT/opd-NAME and OUT/eval-NAME, from the SFT'd students and pools already under OUT")
    ap.add_argument("--opd-set", action="append", default=[], metavar="KEY=VALUE", help="more -S for the OPD runs")
    ap.add_argument("--report-only", action="store_true", help="only the report and summary, from the runs and evals "
                    "under --out (no job is checked or run)")
    args = ap.parse_args(argv)
    out, seeds, modes = Path(args.out), [int(s) for s in args.seeds.split(",")], args.modes.split(",")
    sources, sfx = args.sources.split(","), f"-{args.variant}" if args.variant else ""
    logs = out / "logs"
    data = {"teacher": [], "carry": [f"data.train={carry_rows(out)}"]}
    commands: list[str] = []

    def job(name, argv, inputs, outputs, cost=1.0) -> Job:
        commands.append("opdkit " + " ".join(argv))
        # the whole command line is the job's config: a changed -S runs it again (Job.command() leaves -S out)
        return Job(name, tuple(argv), tuple(map(str, inputs)), tuple(map(str, outputs)), {"argv": list(argv)}, cost,
                   str(logs / f"{name.replace('/', '-')}.log"))

    # 1. the SFT'd starting students
    sft = {src: out / "sft" / src for src in SOURCES}
    phase("sft", [job(f"sft/{src}", ["train", "--out", str(sft[src]), *params_args(args.params, [
        "loss.name=sft", *SOURCES[src], *data[src], f"budget.max_steps={args.sft_steps}", "optim.warmup_steps=5",
        f"publish.every_steps={args.sft_steps}", "seed=0"])], [], [sft[src]]) for src in SOURCES],
        out, args.workers, args.report_only or bool(sfx))
    start = {src: sft[src] / "checkpoints" / f"checkpoint-{args.sft_steps}" for src in SOURCES}

    # 2. their pools, and their own evals
    pools = {src: out / "pools" / f"{src}.parquet" for src in SOURCES}
    opd_sets = ["loss.name=k1", f"budget.max_steps={args.steps}", f"publish.every_steps={args.every}",
                "publish.keep=10"]
    run_sets = [*opd_sets, *args.opd_set]  # a variant's -S on its OPD runs (the pools are the study's)
    phase("pools", [job(f"pools/{src}", ["offline-rollouts", "--policy", str(start[src]), "--out", str(pools[src]),
                                         *params_args(args.params,
                                                      [f"student.path={start[src]}", "seed=0", *opd_sets])],
                        [start[src]], [pools[src]], cost=2.0) for src in SOURCES],
          out, args.workers, args.report_only or bool(sfx))

    # 3. OPD, online and offline, each seed
    runs = {(src, mode, s): out / f"opd{sfx}" / f"{src}_{mode}" / f"seed{s}" for src in sources for mode in modes
            for s in seeds}
    phase(f"opd{sfx}", [job(f"opd{sfx}/{src}_{mode}/seed{s}", ["train", "--out", str(d), *params_args(args.params, [
        f"student.path={start[src]}", f"seed={s}", *run_sets, *MODES[mode],
        *([f"rollout.offline_file={pools[src]}"] if mode != "online" else [])])],
        [start[src], *([pools[src]] if mode != "online" else [])], [d], cost=3.0 if mode == "online" else 1.0)
        for (src, mode, s), d in runs.items()], out, args.workers, args.report_only)

    # 4. evals: the SFT'd students and every kept checkpoint of every run
    evals, jobs = {}, []
    for src in sources:
        f = out / f"eval{sfx}" / f"sft_{src}" / "seed0.json"
        evals[(f"sft_{src}", 0, args.sft_steps)] = f
        jobs.append(job(f"eval{sfx}/sft_{src}", ["eval", "--model", str(start[src]), "--out", str(f), "--tag",
                                            f"arm=sft_{src}", "--tag", "seed=0", *params_args(args.params, [])],
                        [start[src]], [f, f.with_suffix(".jsonl")]))
    for (src, mode, s), d in runs.items():
        for step in range(args.every, args.steps + 1, args.every):
            arm = f"{src}_{mode}"
            f = out / f"eval{sfx}" / arm / (f"seed{s}.json" if step == args.steps else f"seed{s}-step{step}.json")
            evals[(arm, s, step)] = f
            ck = d / "checkpoints" / f"checkpoint-{step}"
            argv = ["eval", "--model", str(ck), "--out", str(f), "--tag", f"arm={arm}", "--tag", f"seed={s}",
                    "--tag", f"step={step}", *params_args(args.params, [])]
            jobs.append(job(f"eval{sfx}/{arm}/seed{s}/{step}", argv, [ck], [f, f.with_suffix(".jsonl")]))
    phase(f"eval{sfx}", jobs, out, args.workers, args.report_only)

    # 5. the report, per source against its online arm, and the summary
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    summary = {"settings": vars(args), "sources": {}, "commands": commands}
    for src in sources:
        finals = [evals[(f"{src}_{m}", s, args.steps)] for m in modes for s in seeds]
        rep = report([evals[(f"sft_{src}", 0, args.sft_steps)], *finals], baseline=f"{src}_online")
        (results / f"report_{src}{sfx}.json").write_text(json.dumps(rep, indent=2) + "\n")
        meta = read_meta(pools[src])
        curves = {m: {step: sum(json.loads(evals[(f"{src}_{m}", s, step)].read_text())["accuracy"] for s in seeds)
                      / len(seeds) for step in range(args.every, args.steps + 1, args.every)} for m in modes}
        phases = {m: step_phases([runs[(src, m, s)] for s in seeds]) for m in modes}
        summary["sources"][src] = {"groups": rep["groups"], "comparisons": rep.get("comparisons", {}),
                                   "step_seconds_median": phases,
                                   "pool": {"seconds": meta["seconds"], "tokens": meta["tokens"],
                                            "n_prompts": meta["n_prompts"]},
                                   "curves": curves}
    if len(sources) > 1:  # across sources: every final against the consistent online arm, and the offline gaps
        finals = [evals[(f"{src}_{m}", s, args.steps)] for src in sources for m in modes for s in seeds]
        rep = report(finals, baseline=f"{sources[0]}_online")
        (results / f"report_all{sfx}.json").write_text(json.dumps(rep, indent=2) + "\n")
        acc = {(src, m, s): json.loads(evals[(f"{src}_{m}", s, args.steps)].read_text())["accuracy"]
               for src in sources for m in modes for s in seeds}
        summary["across_sources"] = {"comparisons": rep.get("comparisons", {}), "offline_gap": {}}
        for m in modes[1:] if modes[0] == "online" else []:
            gaps = {src: {s: acc[(src, m, s)] - acc[(src, "online", s)] for s in seeds} for src in sources}
            summary["across_sources"]["offline_gap"][m] = {
                "per_source": {src: {"per_seed": g, **repeat_stats(list(g.values()))} for src, g in gaps.items()},
                # the second source's gap against the first's, paired by seed (a difference in differences)
                "difference": gap_difference(gaps[sources[1]], gaps[sources[0]])}
    (results / f"summary{sfx}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({src: {arm: [g["mean"], g["se"], g.get("train_s")] for arm, g in v["groups"].items()}
                      for src, v in summary["sources"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

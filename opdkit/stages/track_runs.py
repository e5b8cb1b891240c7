"""DVC stage ``track``: the runs' DVCLive logs and learning curves, in the form dvc plots and dvc metrics read.

A dvc.yaml plot or metric names its files (no globs; a directory stands for one plot per file), and the
pipeline's runs are an arm x seed matrix that params.yaml decides. This stage gathers, for every run of
the matrix (``opdkit.studies.report.pipeline_matrix``), its DVCLive log ``RUNS/<arm>/seed<n>/dvclive``
(``opdkit.tracking``) and its learning curve ``CURVES/<arm>/seed<n>/curve.json`` into::

    OUT/plots/<name>.tsv        columns run, step, <name>: a row per run and step, for each name of
                                PLOTTED that the run logs (clipped_mass: the fkl / rkl / jsd arms)
    OUT/plots/eval_accuracy.tsv columns run, step, accuracy: each evaluated checkpoint of each run
    OUT/metrics.json            {arm: {seed<n>: {step, the last value of each of PLOTTED, eval_accuracy}}}

dvc.yaml declares ``OUT/plots`` as plots (``x: step``, the template ``.dvc/plots/by_run.json``: a line per
run, dashed by revision in ``dvc plots diff``) and ``OUT/metrics.json`` as metrics (``dvc metrics show``,
``dvc exp show``). A run that did not complete, whose run.json records a tracking failure or another
tracker, or whose DVCLive summary stops short of its last step is an error naming it (exit 1, nothing
written): no plot is silently short.

    python -m opdkit.stages.track_runs --runs runs/train --curves runs/curves --out runs/track [-p params.yaml] [-S k=v]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

from opdkit.config import ConfigError, load_config as load_as_is
from opdkit.persist.fsutil import atomic_write_json, atomic_write_text
from opdkit.studies.report import pipeline_matrix
from opdkit.tracking import DVCLIVE_DIR, DVCLIVE_METRICS, DVCLIVE_SUMMARY

PLOTTED = ("loss", "kl", "lr", "clipped_mass")  # train.jsonl names drawn per step (DVCLive's history files)
ACCURACY = "eval_accuracy"  # the learning curves' plot (OUT/plots/eval_accuracy.tsv) and metric


class TrackError(ValueError):
    """A run whose log cannot be plotted as it stands (the message names it and what to do)."""


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise TrackError(f"{path} does not exist ({what})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TrackError(f"{path} is not valid JSON ({what}): {e}") from None


def _history(tsv: Path) -> list[tuple[int, str]]:
    """(step, value as DVCLive wrote it) of one DVCLive history file (columns step and the value)."""
    with tsv.open(newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    if not rows or rows[0] != ["step", tsv.stem]:
        raise TrackError(f"{tsv}: expected DVCLive's columns step and {tsv.stem}, got {rows[:1]}")
    return [(int(step), value) for step, value in rows[1:]]


def check_run(run: Path) -> dict:
    """The DVCLive summary of a completed run whose log covers every step; else ``TrackError``."""
    state = _read_json(run / "run.json", "the run's record; has the train stage run?")
    if state.get("status") != "completed":
        raise TrackError(f"{run} did not complete (run.json: {state.get('status')!r}); run the train stage again")
    tracked = state.get("tracking") or {}
    if tracked.get("error") or tracked.get("kind", "dvclive") != "dvclive":
        raise TrackError(f"{run}: its DVCLive log is incomplete (run.json tracking: {tracked}); the track stage "
                         "reads DVCLive logs (params key tracking: dvclive): remove the run's folder and "
                         "run `dvc repro` again")
    summary = _read_json(run / DVCLIVE_DIR / DVCLIVE_SUMMARY, "DVCLive's summary; params key tracking: dvclive")
    if summary.get("step") != state.get("step"):
        raise TrackError(f"{run}: its DVCLive log ends at step {summary.get('step')} but the run at step "
                         f"{state.get('step')}; remove the run's folder and run `dvc repro` again")
    return summary


def gather(runs: Path, curves: Path, matrix: list[tuple[str, int]]) -> tuple[dict[str, str], dict]:
    """``({plot file name: TSV text}, metrics)`` for the runs of ``matrix`` (see the module docstring)."""
    tables: dict[str, list[list]] = {}
    metrics: dict[str, dict] = {}
    for arm, seed in matrix:
        run, name = runs / arm / f"seed{seed}", f"{arm}/seed{seed}"
        summary = check_run(run)
        final = {"step": summary["step"]}
        for key in PLOTTED:
            tsv = run / DVCLIVE_DIR / DVCLIVE_METRICS / f"{key}.tsv"
            if tsv.is_file():
                tables.setdefault(key, []).extend([name, step, value] for step, value in _history(tsv))
                final[key] = summary[key]
        points = _read_json(curves / arm / f"seed{seed}" / "curve.json", "the run's learning curve; has the eval "
                            "stage run?")["points"]
        tables.setdefault(ACCURACY, []).extend([name, p["step"], p["accuracy"]] for p in points)
        final[ACCURACY] = points[-1]["accuracy"]
        metrics.setdefault(arm, {})[f"seed{seed}"] = final
    texts = {}
    for key, rows in tables.items():
        buf = io.StringIO()
        w = csv.writer(buf, delimiter="\t", lineterminator="\n")
        w.writerow(["run", "step", "accuracy" if key == ACCURACY else key])  # the plotted column last (dvc's y)
        w.writerows(rows)
        texts[f"{key}.tsv"] = buf.getvalue()
    return texts, metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opdkit.stages.track_runs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="the train stage's folder (RUNS/<arm>/seed<n>)")
    ap.add_argument("--curves", required=True,
                    help="the eval stage's learning curves (CURVES/<arm>/seed<n>/curve.json)")
    ap.add_argument("--out", required=True, help="OUT/plots/*.tsv and OUT/metrics.json")
    ap.add_argument("-p", "--params", default="params.yaml")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    try:
        matrix = pipeline_matrix(load_as_is(args.params, args.overrides))
        texts, metrics = gather(Path(args.runs), Path(args.curves), matrix)
    except (ConfigError, TrackError) as e:
        print(f"opdkit.stages.track_runs: error: {e}", file=sys.stderr)
        return 1
    out = Path(args.out)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        atomic_write_text(out / "plots" / name, text)
    atomic_write_json(out / "metrics.json", metrics)
    print(f"track: {len(matrix)} runs -> {out}/plots ({', '.join(sorted(texts))}), {out}/metrics.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Repeat-run reports over eval JSONs, and the readers the analysis notebooks share.

``report(paths, baseline, group_key)`` is what ``opdkit report`` prints: one row per eval JSON
(``runs``), the repeat statistics of each group of runs (``groups``: mean, sd, se over seeds, and
the mean within-eval clustered stderr), and each group's difference against the baseline group
(``comparisons``: Welch ``diff``, its ``se`` and ``diff_in_se`` = diff / se, as OPD experiment
logs report "+1.8 SE vs the baseline"; ``diff_in_baseline_se`` = diff / the baseline's own se).
The statistics are ``opdkit.stats``'s; this module only gathers the inputs and shapes the output.

An eval JSON is the ``opdkit eval`` output (DESIGN.md): ``accuracy``, ``stderr`` and the tags
given with ``--tag`` (the pipeline tags ``arm=<loss.name>`` and ``seed=<n>``). The per-sample
records sit beside it with the suffix ``.jsonl``.

The pipeline's runs are named by a pattern, e.g. ``runs/eval/{arm}/seed{seed}.json``, filled in for
each (arm, seed) of dvc.yaml's train matrix (``pipeline_matrix``), so the report and the notebooks
read exactly the runs params.yaml lists: outputs of a seed or arm dropped from params.yaml that
still lie under ``runs/`` are never counted (a directory, by contrast, stands for all it holds).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from opdkit.config import Config
from opdkit.stats import compare_arms, summarize_runs

RUN_FIELDS = ("accuracy", "stderr", "n_questions", "n_samples", "truncated_frac", "mean_response_tokens")
PATTERN_FIELDS = ("{arm}", "{seed}")


def pipeline_matrix(cfg: Config) -> list[tuple[str, int]]:
    """The (arm, seed) pairs dvc.yaml trains and evaluates: arms ``loss.name`` then
    ``pipeline.baseline_arm`` (one arm when they are equal), each over ``pipeline.seeds``.

    Pass the params as dvc.yaml reads them (``opdkit.config.load_config("params.yaml")``, without
    the recipe: the train stages set ``loss.name`` to the arm with ``-S``, over any recipe)."""
    arms = dict.fromkeys([cfg.loss.name, cfg.pipeline.baseline_arm])
    return [(arm, seed) for arm in arms for seed in cfg.pipeline.seeds]


def expand_runs(paths: list[str | Path], cfg: Config) -> list[Path]:
    """``paths`` with each one that holds ``{arm}`` or ``{seed}`` replaced by its instances for
    every (arm, seed) of ``pipeline_matrix(cfg)`` (in that order); other paths as given."""
    out: list[Path] = []
    for p in map(str, paths):
        if not any(f in p for f in PATTERN_FIELDS):
            out.append(Path(p))
            continue
        try:
            out.extend(dict.fromkeys(Path(p.format(arm=arm, seed=seed)) for arm, seed in pipeline_matrix(cfg)))
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"run pattern {p!r}: only {{arm}} and {{seed}} can be filled in ({type(e).__name__}: {e})") from None
    return out


def eval_paths(paths: list[str | Path]) -> list[Path]:
    """Eval JSON files: each path as given, a directory as its ``*.json`` files (sorted);
    duplicates (the same file named twice) are kept once, in first-seen order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.json"))
            if not found:
                raise FileNotFoundError(f"report: directory {p} holds no eval JSON (*.json)")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"report: eval JSON {p} does not exist")
    seen, unique = set(), []
    for p in out:
        if p.resolve() not in seen:
            seen.add(p.resolve())
            unique.append(p)
    return unique


def _seed(value):
    """Tags arrive as strings: ``"3"`` -> 3 (so seeds sort as numbers), anything else unchanged."""
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def load_evals(paths: list[str | Path], group_key: str = "arm") -> list[dict]:
    """One record per eval JSON: ``file``, ``group_key``, ``seed`` and ``RUN_FIELDS``.

    Raises ``ValueError`` naming the file when a JSON lacks ``accuracy``/``stderr`` or the group
    tag (evaluate with ``opdkit eval --tag arm=NAME --tag seed=N``). A missing ``seed`` is 0.
    """
    records = []
    for p in eval_paths(paths):
        raw = json.loads(p.read_text())
        missing = [k for k in ("accuracy", "stderr", group_key) if k not in raw]
        if missing:
            raise ValueError(f"report: {p} lacks {missing}; expected an `opdkit eval` JSON written with "
                             f"--tag {group_key}=NAME --tag seed=N")
        rec = {"file": str(p), group_key: raw[group_key], "seed": _seed(raw.get("seed", 0))}
        rec.update({k: raw[k] for k in RUN_FIELDS if k in raw})
        records.append(rec)
    return records


def _finite(x):
    """JSON without NaN/inf: NaN -> None, +-inf -> "inf"/"-inf" (recursively)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def report(paths: list[Path], baseline: str | None = None, group_key: str = "arm") -> dict:
    """Repeat-run statistics over eval JSONs (files or directories of them), grouped by
    ``group_key``; ``baseline`` names the group the others are compared with (None: no
    comparisons). Groups with fewer than 2 runs are summarised (sd/se null) but not compared.
    NaN/inf never appear in the result (null / "inf"), so it is strict JSON."""
    runs = load_evals(paths, group_key)
    runs.sort(key=lambda r: (str(r[group_key]), str(r["seed"])))
    groups = summarize_runs(runs, group_key=group_key)
    comparisons, skipped = {}, {}
    if baseline is not None:
        if baseline not in groups:
            raise ValueError(f"report: baseline {group_key}={baseline!r} is not among the evals "
                             f"(groups: {', '.join(map(str, groups))})")
        base = [r["accuracy"] for r in runs if r[group_key] == baseline]
        for name in groups:
            if name == baseline:
                continue
            vals = [r["accuracy"] for r in runs if r[group_key] == name]
            if len(vals) < 2 or len(base) < 2:
                skipped[name] = f"needs >= 2 runs in both groups (has {len(vals)} vs {len(base)} for {baseline})"
                continue
            c = compare_arms(vals, base)
            se_base = c["baseline"]["se"]
            comparisons[name] = {
                "diff": c["diff"], "se": c["se"], "diff_in_se": c["diff_in_se"], "df": c["df"],
                "p_value": c["p_value"], "p_method": c["p_method"],
                "diff_in_baseline_se": c["diff"] / se_base if se_base > 0 else float("nan"),
            }
    return _finite({"group_key": group_key, "baseline": baseline, "runs": runs, "groups": groups,
                    "comparisons": comparisons, "not_compared": skipped})


def format_report(result: dict) -> str:
    """The report as a few lines of text: 'arm: mean +- se (sd, n seeds) ... +x.x SE vs base'."""
    lines = []
    for name, g in result["groups"].items():
        se = "n/a" if g["se"] is None else f"{g['se']:.4f}"
        sd = "n/a" if g["sd"] is None else f"{g['sd']:.4f}"
        line = f"{name}: {g['mean']:.4f} +- {se} (sd {sd}, {g['n']} run(s); mean eval stderr {g['mean_stderr']:.4f})"
        c = result["comparisons"].get(name)
        if c is not None and c["diff_in_se"] is not None:
            line += f"; {c['diff']:+.4f} = {c['diff_in_se']:+.2f} SE vs {result['baseline']}"
        lines.append(line)
    return "\n".join(lines)


# --- readers for the notebooks ----------------------------------------------------------------


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines file (a torn last line, from a killed writer, is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def train_dirs(paths: list[str | Path]) -> list[Path]:
    """Training output directories: each path that holds ``metrics/train.jsonl``, or else its
    immediate subdirectories that do (e.g. ``runs/train/rkl`` -> its ``seed*`` runs), sorted."""
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics" / "train.jsonl").is_file():
            out.append(p)
            continue
        found = sorted(d for d in p.iterdir() if (d / "metrics" / "train.jsonl").is_file()) if p.is_dir() else []
        if not found:
            raise FileNotFoundError(f"{p} is neither an `opdkit train --out` directory nor a directory of them")
        out.extend(found)
    return out


def run_label(run_dir: str | Path) -> str:
    """``"<loss.name> seed <seed>"`` from the resolved params a run saved (``config.yaml``)."""
    from opdkit.config import load_config

    cfg = load_config(Path(run_dir) / "config.yaml")
    return f"{cfg.loss.name} seed {cfg.seed}"


def train_metrics(run_dir: str | Path) -> list[dict]:
    """``metrics/train.jsonl`` of a training output directory (one dict per step)."""
    f = Path(run_dir) / "metrics" / "train.jsonl"
    if not f.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics/train.jsonl: is it an `opdkit train --out` directory?")
    return read_jsonl(f)


def per_question_correct(eval_json: str | Path) -> dict[str, list[float]]:
    """``{question id: [0/1 per sample]}`` from the per-sample records beside an eval JSON
    (the input of ``stats.clustered_accuracy`` and ``stats.paired_question_diff``)."""
    table: dict[str, list[float]] = {}
    for r in read_jsonl(Path(eval_json).with_suffix(".jsonl")):
        table.setdefault(str(r["id"]), []).append(float(r["correct"]))
    return table

"""Repeat-run reports over eval JSONs, learning curves, and the readers the analysis notebooks share.

``report(paths, baseline, group_key)`` is what ``opdkit report`` prints: one row per eval JSON
(``runs``), the repeat statistics of each group of runs (``groups``: mean, sd, se over seeds, the
mean within-eval clustered stderr, and the arm's ``steps`` and ``match`` tags), and each group's
difference against the baseline group (``comparisons``): Welch's unpaired test (``diff``, its ``se``,
``diff_in_se`` = diff / se, as OPD experiment logs report "+1.8 SE vs the baseline", ``df``,
``p_value``) and ``paired`` (by seed: the same seed's prompt order and sample seeds in both arms;
the mean and se of the per-seed differences, ``p_value`` of the paired t-test, df = seeds - 1);
``diff_in_baseline_se`` = diff / the baseline's own se. The statistics are ``opdkit.stats``'s; this
module only gathers the inputs and shapes the output.

Training seconds: an eval of a checkpoint that ``opdkit train`` published (its ``model`` holds an
``opdkit.json``) carries the run's ``train_s``, its wall clock at that step (start-up included) as
measured on the machine that ran it; each group has their mean (``train_s``) and, against the
baseline, ``train_s_ratio``. An arm matched to the baseline by wall clock (``match: wall``) whose
ratio is off by more than ``WALL_MATCH_TOL`` is listed in ``wall_mismatch`` (its step budget was
calibrated elsewhere or under other load: recalibrate on this machine, docs/calibration.md).

An eval JSON is the ``opdkit eval`` output (docs/design.md, "Metrics"): ``accuracy``, ``stderr`` and the tags
given with ``--tag`` (the pipeline tags ``arm=<arm>``, ``seed=<n>``, ``step=<checkpoint step>`` and
``match=steps|wall``). The per-sample records sit beside it with the suffix ``.jsonl``.

The pipeline's arms (``pipeline_arms``): the OPD arms ``loss.name`` and ``pipeline.baseline_arm`` at
``budget.max_steps``, and the supervised controls of ``pipeline.controls`` at their own step budgets.
Its runs are named by a pattern, e.g. ``runs/eval/{arm}/seed{seed}.json``, filled in for each (arm,
seed) of dvc.yaml's train matrices (``pipeline_matrix``), so the report and the notebooks read
exactly the runs params.yaml lists: outputs of a seed or arm dropped from params.yaml that still lie
under ``runs/`` are never counted (a directory, by contrast, stands for all it holds).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from opdkit.config import Config, ConfigError
from opdkit.stats import (
    compare_arms,
    detectable_effect,
    paired_question_diff,
    repeat_stats,
    repeats_needed,
    summarize_runs,
)

RUN_FIELDS = ("accuracy", "stderr", "n_questions", "n_samples", "truncated_frac", "mean_response_tokens")
TAG_FIELDS = ("step", "match")  # the pipeline's tags of an arm's run, kept per group
PATTERN_FIELDS = ("{arm}", "{seed}")
RESERVED_ARMS = ("before", "teacher", "reference")  # the reference evals' tags and folder
WALL_MATCH_TOL = 0.10  # a wall-matched arm's training seconds may differ from the baseline's by this share
CHECKPOINT_META = "opdkit.json"  # a published checkpoint's record (persist.checkpoints.MANIFEST): step, elapsed_s


@dataclass(frozen=True)
class Arm:
    """One arm of the pipeline: what its train stages set over params.yaml (``-S`` in dvc.yaml), its
    step budget, and how it is matched to the baseline (``baseline``, ``steps`` or ``wall``)."""

    name: str
    overrides: tuple[str, ...]
    steps: int
    match: str


def pipeline_arms(cfg: Config) -> list[Arm]:
    """The arms dvc.yaml trains: ``loss.name`` then ``pipeline.baseline_arm`` (one arm when they are
    equal) at ``budget.max_steps``, then each of ``pipeline.controls`` (``loss.name=sft`` from the teacher
    model, its own ``steps`` and checkpoint spacing). Raises ``ConfigError`` for a repeated or reserved name.

    Pass the params as dvc.yaml reads them (``opdkit.config.load_config("params.yaml")``, without
    the recipe: the train stages set these keys with ``-S``, over any recipe)."""
    opd = dict.fromkeys([cfg.loss.name, cfg.pipeline.baseline_arm])
    arms = [Arm(name, (f"loss.name={name}",), cfg.budget.max_steps,
                "baseline" if name == cfg.pipeline.baseline_arm else "steps") for name in opd]
    arms += [Arm(c.name, ("loss.name=sft", f"loss.sft_source={c.sft_source}", "teacher.source=model",
                          "data.pad_side=left", "loss.reward_weight=0",  # supervised: no reward (opdkit.rewards)
                          "rollout.source=live",  # its own samples (teacher's, references'), not an offline pool
                          f"budget.max_steps={c.steps}", f"publish.every_steps={c.every_steps}"), c.steps, c.match)
             for c in cfg.pipeline.controls]
    names = [a.name for a in arms]
    clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & set(RESERVED_ARMS)))
    if clash:
        raise ConfigError(f"params key 'pipeline.controls': arm name(s) {clash} repeat an OPD arm (loss.name, "
                          f"pipeline.baseline_arm), another control, or a reserved name ({', '.join(RESERVED_ARMS)})")
    return arms


def pipeline_matrix(cfg: Config) -> list[tuple[str, int]]:
    """The (arm, seed) pairs dvc.yaml trains and evaluates: each of ``pipeline_arms(cfg)`` over
    ``pipeline.seeds``."""
    return [(arm.name, seed) for arm in pipeline_arms(cfg) for seed in cfg.pipeline.seeds]


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
            raise ValueError(f"run pattern {p!r}: only {{arm}} and {{seed}} can be filled in "
                             f"({type(e).__name__}: {e})") from None
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


def checkpoint_record(eval_json: dict) -> dict | None:
    """The ``opdkit.json`` of the checkpoint an eval JSON evaluated (its ``model``), or None when that is not a
    checkpoint of ``opdkit train`` (here)."""
    meta = Path(str(eval_json.get("model", ""))) / CHECKPOINT_META
    if not eval_json.get("model") or not meta.is_file():
        return None
    return json.loads(meta.read_text())


def train_seconds(eval_json: dict) -> float | None:
    """The training seconds of the checkpoint an eval JSON evaluated (``elapsed_s`` of its
    ``opdkit.json``), or None when its ``model`` is not a checkpoint of ``opdkit train`` (here)."""
    elapsed = (checkpoint_record(eval_json) or {}).get("elapsed_s")
    return float(elapsed) if isinstance(elapsed, (int, float)) else None


# What names or places a run rather than what it trains (left out of an arm's settings), and what a checkpoint
# records beside its params that a comparison must hold equal too (the training data). Its code_revision (the git
# commit) is not a setting: any commit, a documentation one too, changes it, and dvc trains a seed added later on
# the newer commit (the report lists the revisions per group instead)
NOT_SETTINGS = ("seed", "experiment_name", "runtime.state_dir", "pipeline.")
RECORD_SETTINGS = ("data_fingerprint",)


def train_settings(record: dict | None) -> dict | None:
    """What a checkpoint was trained with, from its ``opdkit.json`` ``record`` (``checkpoint_record``): its params
    flattened to dotted keys (``{"loss.name": "rkl", ...}``) less ``NOT_SETTINGS``, with the record's
    ``RECORD_SETTINGS``; None without a record (the eval's model is not a checkpoint of ``opdkit train``)."""
    if record is None or not isinstance(record.get("params"), dict):
        return None

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    settings = {k: v for k, v in flat(record["params"]).items()
                if not any(k == n or (n.endswith(".") and k.startswith(n)) for n in NOT_SETTINGS)}
    return {**settings, **{k: record.get(k) for k in RECORD_SETTINGS}}


def arm_settings(runs: list[dict], group_key: str, records: dict) -> tuple[dict, dict, dict]:
    """Per group of ``runs`` (``load_evals``'s records; ``records``: each one's ``checkpoint_record`` by its
    ``file``): the ``train_settings`` its runs share (None where no run of it is a checkpoint of ``opdkit
    train``); where those runs differ, ``{key: [each one's value]}`` (in ``runs``' order); and the number of its
    runs whose settings are unknown (their model no such checkpoint), where some are known."""
    shared, varies, unknown = {}, {}, {}
    for name in dict.fromkeys(r[group_key] for r in runs):
        each = [train_settings(records[r["file"]]) for r in runs if r[group_key] == name]
        known = [x for x in each if x is not None]
        if not known:
            shared[name] = None
            continue
        if len(known) < len(each):
            unknown[name] = len(each) - len(known)
        keys = sorted(set().union(*known))
        differ = {k: [x.get(k) for x in known] for k in keys
                  if len({json.dumps(x.get(k), sort_keys=True) for x in known}) > 1}
        shared[name] = {k: known[0].get(k) for k in keys if k not in differ}
        if differ:
            varies[name] = differ
    return shared, varies, unknown


def setting_changes(baseline: dict | None, arm: dict | None, unshared: frozenset = frozenset()) -> dict | None:
    """``{key: [baseline's value, arm's value]}`` for the settings the two hold differently (a key one lacks:
    None), but ``unshared`` (keys whose value differs among one group's runs: ``arm_settings``'s); None when
    either is unknown."""
    if baseline is None or arm is None:
        return None
    return {k: [baseline.get(k), arm.get(k)] for k in sorted((set(baseline) | set(arm)) - unshared)
            if json.dumps(baseline.get(k), sort_keys=True) != json.dumps(arm.get(k), sort_keys=True)}


def load_evals(paths: list[str | Path], group_key: str = "arm") -> list[dict]:
    """One record per eval JSON: ``file``, ``group_key``, ``seed``, ``RUN_FIELDS`` and, for a
    checkpoint of ``opdkit train``, ``train_s`` (``train_seconds``).

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
        rec.update({k: _seed(raw[k]) for k in TAG_FIELDS if k in raw})
        secs = train_seconds(raw)
        if secs is not None:
            rec["train_s"] = secs
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


def _tag(runs: list[dict], key: str):
    """The one value of tag ``key`` among ``runs`` (None if absent; a list if they disagree)."""
    values = list(dict.fromkeys(r[key] for r in runs if key in r))
    return None if not values else values[0] if len(values) == 1 else values


def paired_seed_diff(arm: dict, baseline: dict) -> dict:
    """Paired comparison over the seeds both arms ran (``{seed: accuracy}`` each): the per-seed
    differences' mean, se and paired t-test, i.e. ``stats.paired_question_diff`` with each seed as the
    unit (one score per unit). ``n`` seeds; ``seeds`` the common ones."""
    common = [s for s in arm if s in baseline]
    r = paired_question_diff([[arm[s]] for s in common], [[baseline[s]] for s in common])
    return {"diff": r["diff"], "se": r["se"], "diff_in_se": r["diff_in_se"], "df": len(common) - 1,
            "p_value": r["p_value"], "p_method": r["p_method"], "n": len(common), "seeds": common}


PLAN_POWER, PLAN_ALPHA = 0.8, 0.05  # the power and level ``planning`` plans for


def planning(welch: dict, paired: dict | None) -> dict:
    """What the seeds of a comparison can find, at ``PLAN_POWER`` and a two-sided ``PLAN_ALPHA``
    (``stats.detectable_effect``, ``stats.repeats_needed``): ``sd`` the two arms' seed spread pooled
    (sqrt of the mean of their variances), ``n`` the smaller arm's seeds, ``detectable_diff`` the smallest
    difference those seeds find with that probability, ``repeats_for_diff`` the seeds per arm the observed
    difference would need (null for a difference of 0; a count past ``stats.repeats_needed``'s ``most``
    means practically none). ``paired`` (with a seed-paired comparison ``paired``): the same for the
    per-seed differences, ``sd`` their spread. Null figures where a spread is 0 or undefined."""
    def figures(sd: float, n: int, diff: float, is_paired: bool) -> dict:
        ok = math.isfinite(sd) and sd > 0 and n >= 2
        kw = dict(power=PLAN_POWER, alpha=PLAN_ALPHA, paired=is_paired)
        return {"sd": sd if math.isfinite(sd) else None, "n": n,
                "detectable_diff": detectable_effect(sd, n, **kw) if ok else None,
                "repeats_for_diff": repeats_needed(abs(diff), sd, **kw) if ok and diff != 0 else None}

    a, b = welch["arm"], welch["baseline"]
    out = {"power": PLAN_POWER, "alpha": PLAN_ALPHA,
           **figures(math.sqrt((a["sd"] ** 2 + b["sd"] ** 2) / 2), min(a["n"], b["n"]), welch["diff"], False)}
    out["paired"] = (figures(paired["se"] * math.sqrt(paired["n"]), paired["n"], paired["diff"], True)
                     if paired is not None else None)
    return out


def report(paths: list[Path], baseline: str | None = None, group_key: str = "arm") -> dict:
    """Repeat-run statistics over eval JSONs (files or directories of them), grouped by
    ``group_key``; ``baseline`` names the group the others are compared with (None: no
    comparisons). Groups with fewer than 2 runs are summarised (sd/se null) but not compared; the
    paired comparison needs >= 2 seeds in common. NaN/inf never appear in the result (null /
    "inf"), so it is strict JSON."""
    runs = load_evals(paths, group_key)
    runs.sort(key=lambda r: (str(r[group_key]), str(r["seed"])))
    groups = summarize_runs(runs, group_key=group_key)
    records = {r["file"]: checkpoint_record(json.loads(Path(r["file"]).read_text())) for r in runs}
    for name, g in groups.items():
        mine = [r for r in runs if r[group_key] == name]
        secs = [r["train_s"] for r in mine if "train_s" in r]
        revs = [(records[r["file"]] or {}).get("code_revision") for r in mine]
        g.update(steps=_tag(mine, "step"), match="baseline" if name == baseline else _tag(mine, "match"),
                 train_s=float(np.mean(secs)) if secs else None,
                 code_revisions=sorted({r for r in revs if r}))
    wall_mismatch = _wall_mismatch(groups, baseline)
    settings, varies, unknown = arm_settings(runs, group_key, records)
    confounds = {name: [f"{name}'s runs were not trained alike: " + "; ".join(
        f"{k} {', '.join(map(repr, v))}" for k, v in diff.items())] for name, diff in varies.items()}
    for name, n in unknown.items():
        confounds.setdefault(name, []).append(
            f"{name}: {n} of its runs evaluated a model with no opdkit.json (not a checkpoint of opdkit train, or "
            "moved): what they were trained with is not compared")
    comparisons, skipped = {}, {}
    if baseline is not None:
        if baseline not in groups:
            raise ValueError(f"report: baseline {group_key}={baseline!r} is not among the evals "
                             f"(groups: {', '.join(map(str, groups))})")
        base = {r["seed"]: r["accuracy"] for r in runs if r[group_key] == baseline}
        for name in groups:
            if name == baseline:
                continue
            vals = {r["seed"]: r["accuracy"] for r in runs if r[group_key] == name}
            if len(vals) < 2 or len(base) < 2:
                skipped[name] = f"needs >= 2 runs in both groups (has {len(vals)} vs {len(base)} for {baseline})"
                continue
            c = compare_arms(list(vals.values()), list(base.values()))
            se_base = c["baseline"]["se"]
            paired = paired_seed_diff(vals, base) if len(set(vals) & set(base)) >= 2 else None
            comparisons[name] = {  # Welch (unpaired) at the top level, the seed-paired test under "paired"
                "diff": c["diff"], "se": c["se"], "diff_in_se": c["diff_in_se"], "df": c["df"],
                "p_value": c["p_value"], "p_method": c["p_method"],
                "diff_in_baseline_se": c["diff"] / se_base if se_base > 0 else float("nan"),
                "paired": paired, "match": groups[name]["match"], "steps": groups[name]["steps"],
                "planning": planning(c, paired),
                "changes": setting_changes(settings[baseline], settings[name],
                                           frozenset(varies.get(name, {})) | frozenset(varies.get(baseline, {}))),
            }
            other = [k for k in RECORD_SETTINGS if k in (comparisons[name]["changes"] or {})]
            if other:
                confounds.setdefault(name, []).append(
                    f"{name} was trained on other data ({' and '.join(other)}) than {baseline} (the checkpoints' "
                    "opdkit.json): more changed between them than the arm's settings")
    return _finite({"group_key": group_key, "baseline": baseline, "runs": runs, "groups": groups,
                    "comparisons": comparisons, "not_compared": skipped, "wall_mismatch": wall_mismatch,
                    "confounds": {name: "; ".join(msgs) for name, msgs in confounds.items()}})


def _wall_mismatch(groups: dict, baseline: str | None) -> dict:
    """Sets each group's ``train_s_ratio`` (its mean training seconds / the baseline's); returns
    ``{arm: message}`` for each ``match: wall`` arm whose ratio is off by more than ``WALL_MATCH_TOL``."""
    base_s = groups[baseline]["train_s"] if baseline in groups else None
    out = {}
    for name, g in groups.items():
        g["train_s_ratio"] = g["train_s"] / base_s if g["train_s"] is not None and base_s else None
        if name != baseline and g["match"] == "wall" and g["train_s_ratio"] is not None \
                and abs(g["train_s_ratio"] - 1) > WALL_MATCH_TOL:
            out[name] = (f"{name} is matched to {baseline} by wall clock but trained {g['train_s']:.0f} s against "
                         f"{base_s:.0f} s (x{g['train_s_ratio']:.2f}, more than {WALL_MATCH_TOL:.0%} off) on the "
                         "machine that ran them: recalibrate its steps there (python -m opdkit.stages.calibrate, "
                         "docs/calibration.md) or compare it at matched steps")
    return out


def _num(x, fmt: str) -> str:
    return "n/a" if x is None or isinstance(x, str) else format(x, fmt)


def format_report(result: dict) -> str:
    """The report as a text table: per group steps, training seconds (mean over seeds), match, mean
    +- se over n seeds, and against the baseline the difference, Welch's diff/se and p, and the
    seed-paired diff/se and p; then a line per wall-matched arm whose training seconds are off."""
    head = f"{'arm':<16} {'steps':>6} {'train_s':>7} {'match':<8} {'mean +- se (n)':<22} {'diff':>8} " \
           f"{'Welch SE':>9} {'p':>7} {'paired SE':>9} {'p':>7}"
    lines = [head, "-" * len(head)]
    for name, g in result["groups"].items():
        cell = f"{g['mean']:.4f} +- {_num(g['se'], '.4f')} ({g['n']})"
        secs = _num(g.get("train_s"), ".0f") if g.get("train_s") is not None else ""
        line = f"{str(name):<16} {str(g.get('steps') or ''):>6} {secs:>7} {str(g.get('match') or ''):<8} {cell:<22}"
        c = result["comparisons"].get(name)
        if c is not None:
            pr = c["paired"] or {}
            line += (f" {c['diff']:+8.4f} {_num(c['diff_in_se'], '+9.2f')} {_num(c['p_value'], '7.3f')} "
                     f"{_num(pr.get('diff_in_se'), '+9.2f')} {_num(pr.get('p_value'), '7.3f')}")
        lines.append(line)
    lines.append(f"(diff = arm - {result['baseline']}; SE columns: diff / its standard error; train_s: training "
                 "seconds to the evaluated checkpoint on the machine that ran it; mean eval stderr per group in the "
                 "JSON)")
    lines += [line for name, c in result["comparisons"].items() if (line := _planning_line(name, c))]
    lines += [_changes_line(name, result["baseline"], c["changes"]) for name, c in result["comparisons"].items()
              if c.get("changes") is not None]
    lines += [f"WARNING: {msg}" for msg in result.get("wall_mismatch", {}).values()]
    lines += [f"WARNING: {msg}" for msg in result.get("confounds", {}).values()]
    return "\n".join(lines)


def _changes_line(name, baseline, changes: dict, most: int = 8) -> str:
    """One line of what an arm was trained with otherwise than the baseline (its ``changes``), ``most`` keys."""
    if not changes:
        return f"{name} vs {baseline}: trained alike (the same settings and data): the difference is noise"
    shown = [f"{k} {a!r} -> {b!r}" for k, (a, b) in list(changes.items())[:most]]
    more = f" (+{len(changes) - most} more in the JSON)" if len(changes) > most else ""
    return f"{name} vs {baseline}: {', '.join(shown)}{more}"


def _planning_line(name, comparison: dict) -> str:
    """One line of what a comparison's seeds can find (its ``planning``; '' where it has none)."""
    p = comparison.get("planning") or {}
    if p.get("detectable_diff") is None:
        return ""
    need = p["repeats_for_diff"]
    line = (f"{name}: {p['n']} seeds per arm find a difference of {p['detectable_diff']:.4f} with probability "
            f"{p['power']:.0%} (two-sided {p['alpha']}; seed sd {p['sd']:.4f})")
    if need is not None:
        line += f"; the observed {comparison['diff']:+.4f} would need {need} seeds per arm"
    pp = p.get("paired") or {}
    if pp.get("detectable_diff") is not None:
        line += f"; paired by seed {pp['detectable_diff']:.4f}" + (
            f", {pp['repeats_for_diff']} seeds" if pp["repeats_for_diff"] is not None else "")
    return line


def learning_curves(curve_files: list[str | Path], before: str | Path | None = None) -> dict:
    """Per arm, the learning curve averaged over seeds, from ``opdkit.stages.eval_checkpoints``'s
    ``curve.json`` files (one per run, tagged ``arm`` and ``seed``).

    Returns ``{arm: [point, ...]}`` sorted by step; a point has ``step``, ``mean`` and ``se``
    (accuracy over the seeds evaluated at that step: ``stats.repeat_stats``; se null with one seed),
    ``n``, ``elapsed_s`` and ``tokens`` (means over those seeds: training seconds and cumulative
    completion tokens at that step) and ``elapsed_s_se``. With ``before`` (the eval JSON of the
    student before training) every curve starts at step 0, 0 s, 0 tokens with its accuracy, whose se is
    that eval's clustered stderr (every seed starts from the same model)."""
    by_arm: dict = {}
    for f in map(Path, curve_files):
        c = json.loads(f.read_text())
        if "arm" not in c or "points" not in c:
            raise ValueError(f"learning_curves: {f} is not a curve.json of opdkit.stages.eval_checkpoints "
                             "(needs arm, points)")
        for p in c["points"]:
            by_arm.setdefault(c["arm"], {}).setdefault(p["step"], []).append(p)
    start = json.loads(Path(before).read_text()) if before is not None else None
    out = {}
    for arm, steps in by_arm.items():
        points = [{"step": 0, "mean": start["accuracy"], "se": start["stderr"], "n": 1, "elapsed_s": 0.0,
                   "elapsed_s_se": 0.0, "tokens": 0}] if start is not None and 0 not in steps else []
        for step in sorted(steps):
            ps = steps[step]
            acc, secs = repeat_stats([p["accuracy"] for p in ps]), repeat_stats([p["elapsed_s"] for p in ps])
            points.append({"step": step, "mean": acc["mean"], "se": acc["se"], "n": acc["n"],
                           "elapsed_s": secs["mean"], "elapsed_s_se": secs["se"],
                           "tokens": float(np.mean([p["tokens"] for p in ps]))})
        out[arm] = points
    return _finite(out)


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
    """``"<arm> seed <seed>"`` from the resolved params a run saved (``config.yaml``): the arm is its
    ``experiment_name`` (the pipeline names each run after its arm), else its ``loss.name``."""
    from opdkit.config import load_config

    cfg = load_config(Path(run_dir) / "config.yaml")
    return f"{cfg.experiment_name or cfg.loss.name} seed {cfg.seed}"


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

"""opdkit.studies.report (repeat-run statistics over eval JSONs, `opdkit report`) and opdkit.studies.inspection
(per-token teacher - student log-probs of sampled completions, for the rollout notebook)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from opdkit.cli import main
from opdkit.config import ConfigError, load_config
from opdkit.stats import compare_arms
from opdkit.studies.inspection import delta_colour, inspect_rollouts, summary, tokens_html
from opdkit.studies.report import (
    eval_paths,
    expand_runs,
    format_report,
    learning_curves,
    load_evals,
    per_question_correct,
    pipeline_arms,
    pipeline_matrix,
    report,
    train_dirs,
)

ROOT = Path(__file__).resolve().parents[1]
ACC = {"rkl": [0.50, 0.53, 0.51], "jsd": [0.56, 0.58, 0.55]}


def write_eval(path, arm, seed, accuracy, stderr=0.02, **extra):
    path.parent.mkdir(parents=True, exist_ok=True)
    tags = {"arm": arm} if seed is None else {"arm": arm, "seed": str(seed)}  # --tag values are strings
    path.write_text(json.dumps({"accuracy": accuracy, "stderr": stderr, "n_questions": 300, "n_samples": 1200,
                                "truncated_frac": 0.0, **tags, **extra}))
    return path


@pytest.fixture
def evals(tmp_path):
    for arm, accs in ACC.items():
        for seed, a in enumerate(accs):
            write_eval(tmp_path / "eval" / arm / f"seed{seed}.json", arm, seed, a)
    write_eval(tmp_path / "eval" / "reference" / "before.json", "before", None, 0.30)
    return tmp_path / "eval"


def test_report_groups_and_compares_arms_with_the_stats_functions(evals):
    r = report([evals / "jsd", evals / "rkl", evals / "reference" / "before.json"], baseline="rkl")
    assert [(x["arm"], x["seed"]) for x in r["runs"]] == [
        ("before", 0), ("jsd", 0), ("jsd", 1), ("jsd", 2), ("rkl", 0), ("rkl", 1), ("rkl", 2)]
    g = r["groups"]["jsd"]
    x = np.array(ACC["jsd"])
    assert g["n"] == 3 and g["seeds"] == [0, 1, 2]
    assert g["mean"] == pytest.approx(x.mean()) and g["sd"] == pytest.approx(x.std(ddof=1))
    assert g["se"] == pytest.approx(x.std(ddof=1) / math.sqrt(3)) and g["mean_stderr"] == pytest.approx(0.02)
    ref = compare_arms(ACC["jsd"], ACC["rkl"])
    c = r["comparisons"]["jsd"]
    assert c["diff"] == pytest.approx(ref["diff"]) and c["diff_in_se"] == pytest.approx(ref["diff_in_se"])
    assert c["diff_in_baseline_se"] == pytest.approx(ref["diff"] / ref["baseline"]["se"])
    assert c["diff_in_se"] > 2  # 0.057 apart with se ~0.014: clearly separated
    # one run of `before`: summarised (no sd) but not compared
    assert r["groups"]["before"]["sd"] is None and "before" in r["not_compared"]
    assert "rkl" not in r["comparisons"]
    json.dumps(r, allow_nan=False)  # strict JSON: NaN became null
    table = format_report(r)
    jsd_line = next(ln for ln in table.splitlines() if ln.startswith("jsd "))
    assert "0.5633 +- 0.0088 (3)" in jsd_line and f"{c['diff_in_se']:+.2f}" in jsd_line and "arm - rkl" in table


def test_welch_and_seed_paired_p_values_match_scipy(evals):
    """Welch's t-test and the paired t-test over seeds (seed s of one arm against seed s of the baseline),
    against scipy.stats.ttest_ind(equal_var=False) and ttest_rel on the same per-seed accuracies."""
    from scipy import stats as sps

    c = report([evals / "jsd", evals / "rkl"], baseline="rkl")["comparisons"]["jsd"]
    welch = sps.ttest_ind(ACC["jsd"], ACC["rkl"], equal_var=False)
    assert c["diff_in_se"] == pytest.approx(welch.statistic) and c["p_value"] == pytest.approx(welch.pvalue, rel=1e-6)
    paired = sps.ttest_rel(ACC["jsd"], ACC["rkl"])
    assert c["paired"]["diff_in_se"] == pytest.approx(paired.statistic)
    assert c["paired"]["p_value"] == pytest.approx(paired.pvalue, rel=1e-6)
    assert c["paired"]["n"] == 3 and c["paired"]["df"] == 2 and c["paired"]["seeds"] == [0, 1, 2]
    d = np.subtract(ACC["jsd"], ACC["rkl"])
    assert c["paired"]["se"] == pytest.approx(d.std(ddof=1) / math.sqrt(3))


def test_each_comparison_says_what_its_seeds_can_find(evals):
    """planning: the smallest difference the seeds find with 80% power (two-sided 0.05) and the seeds per arm the
    observed difference would need, from the arms' pooled seed sd (unpaired) and the per-seed differences' sd
    (paired), as stats.detectable_effect / repeats_needed give them; the table says it in a line."""
    from opdkit.stats import detectable_effect, repeats_needed

    r = report([evals / "jsd", evals / "rkl"], baseline="rkl")
    c = r["comparisons"]["jsd"]
    p = c["planning"]
    sd = math.sqrt((np.var(ACC["jsd"], ddof=1) + np.var(ACC["rkl"], ddof=1)) / 2)
    assert (p["power"], p["alpha"], p["n"]) == (0.8, 0.05, 3) and p["sd"] == pytest.approx(sd)
    assert p["detectable_diff"] == pytest.approx(detectable_effect(sd, 3))
    assert p["repeats_for_diff"] == repeats_needed(abs(c["diff"]), sd) == 3  # 2.9 sd apart: 3 seeds suffice
    sd_d = np.subtract(ACC["jsd"], ACC["rkl"]).std(ddof=1)
    assert p["paired"]["sd"] == pytest.approx(sd_d)
    assert p["paired"]["detectable_diff"] == pytest.approx(detectable_effect(sd_d, 3, paired=True))
    line = next(ln for ln in format_report(r).splitlines() if ln.startswith("jsd: 3 seeds per arm"))
    assert f"{p['detectable_diff']:.4f} with probability 80%" in line and "would need 3 seeds per arm" in line
    same = {"rkl": [0.5, 0.5], "jsd": [0.6, 0.6]}  # no spread: nothing to plan from
    flat = report([write_eval(evals.parent / "flat" / f"{a}{i}.json", a, i, v)
                   for a, vals in same.items() for i, v in enumerate(vals)], baseline="rkl")
    assert flat["comparisons"]["jsd"]["planning"]["detectable_diff"] is None
    assert not any(ln.startswith("jsd:") for ln in format_report(flat).splitlines())


def test_opdkit_repeats_plans_seeds_and_refuses_bad_values(capsys):
    """`opdkit repeats`: S1's lesson in numbers (1.5 points of seed noise; a 1-point effect): 37 seeds per arm for 80%
    power unpaired (Cohen's d = 2/3: REPEATS_80 of test_stats.py), and 5 seeds find 3.04 points."""
    assert main(["repeats", "--sd", "0.015", "--effect", "0.01", "--n", "7"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["repeats_per_arm"] == 37 and out["paired"] is False
    assert out["detectable"]["5"] == pytest.approx(0.015 * 2.024440, abs=1e-7) and "7" in out["detectable"]
    assert main(["repeats", "--sd", "0.015", "--effect", "0.01", "--paired"]) == 0
    assert json.loads(capsys.readouterr().out)["repeats_per_arm"] == 20
    assert main(["repeats", "--sd", "-1", "--alpha", "0", "--n", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opdkit: error: repeats: --sd -1.0 (expected > 0") and "--alpha 0.0" in err and "--n 1" in err


def test_paired_comparison_uses_only_the_seeds_both_arms_ran(tmp_path):
    for seed, a in enumerate([0.5, 0.52, 0.49]):
        write_eval(tmp_path / f"b{seed}.json", "rkl", seed, a)
    for seed, a in ((1, 0.6), (2, 0.58), (5, 0.9)):
        write_eval(tmp_path / f"a{seed}.json", "sft_teacher", seed, a, step="178", match="wall")
    r = report([tmp_path], baseline="rkl")
    c = r["comparisons"]["sft_teacher"]
    from scipy import stats as sps

    assert c["paired"]["seeds"] == [1, 2] and c["paired"]["p_value"] == pytest.approx(
        sps.ttest_rel([0.6, 0.58], [0.52, 0.49]).pvalue, rel=1e-6)
    assert c["match"] == "wall" and c["steps"] == 178 and r["groups"]["rkl"]["match"] == "baseline"


def test_report_without_baseline_and_with_duplicate_paths(evals):
    r = report([evals / "rkl", evals / "rkl", evals / "rkl" / "seed0.json"])
    assert len(r["runs"]) == 3 and r["comparisons"] == {} and r["baseline"] is None


def test_report_errors_name_the_file_or_group(evals, tmp_path):
    with pytest.raises(ValueError, match="baseline arm='k1' is not among"):
        report([evals / "rkl"], baseline="k1")
    bad = tmp_path / "untagged.json"
    bad.write_text(json.dumps({"accuracy": 0.5, "stderr": 0.1}))
    with pytest.raises(ValueError, match="untagged.json lacks \\['arm'\\]"):
        report([bad])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        eval_paths([tmp_path / "nope.json"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no eval JSON"):
        eval_paths([tmp_path / "empty"])
    write_eval(tmp_path / "dup" / "a.json", "rkl", 0, 0.5)
    write_eval(tmp_path / "dup" / "b.json", "rkl", 0, 0.6)
    with pytest.raises(ValueError, match="repeats arm='rkl' seed=0"):
        report([tmp_path / "dup"])


def test_report_groups_by_another_key(tmp_path):
    for i, (lr, a) in enumerate([("1e-4", 0.5), ("1e-4", 0.52), ("3e-4", 0.6), ("3e-4", 0.62)]):
        write_eval(tmp_path / f"{i}.json", "rkl", i, a, lr=lr)
    r = report([tmp_path], baseline="1e-4", group_key="lr")
    assert set(r["groups"]) == {"1e-4", "3e-4"} and r["comparisons"]["3e-4"]["diff"] == pytest.approx(0.1)


def test_opdkit_report_cli_prints_and_writes(evals, tmp_path, capsys):
    out = tmp_path / "rep" / "report.json"
    assert main(["report", str(evals / "rkl"), str(evals / "jsd"), "--baseline", "rkl", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    assert printed["groups"]["rkl"]["n"] == 3 and "jsd" in printed["comparisons"]
    out.unlink()
    assert main(["report", str(evals / "rkl"), str(evals / "jsd"), "--baseline", "rkl", "--out", str(out),
                 "--table"]) == 0
    assert capsys.readouterr().out == format_report(json.loads(out.read_text())) + "\n"  # the table; the JSON written


def test_per_question_correct_reads_the_records_beside_the_eval_json(tmp_path):
    f = write_eval(tmp_path / "e.json", "rkl", 0, 0.5)
    rows = [{"id": "q1", "correct": True}, {"id": "q1", "correct": False}, {"id": 7, "correct": True}]
    f.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": "torn')
    assert per_question_correct(f) == {"q1": [1.0, 0.0], "7": [1.0]}
    assert load_evals([f])[0]["seed"] == 0


def test_train_dirs_finds_runs_and_names_what_is_wrong(tmp_path):
    for s in (0, 1):
        (tmp_path / "rkl" / f"seed{s}" / "metrics").mkdir(parents=True)
        (tmp_path / "rkl" / f"seed{s}" / "metrics" / "train.jsonl").write_text('{"step": 1}\n')
    assert [d.name for d in train_dirs([tmp_path / "rkl"])] == ["seed0", "seed1"]
    assert train_dirs([tmp_path / "rkl" / "seed1", tmp_path / "rkl"])[0].name == "seed1"
    with pytest.raises(FileNotFoundError, match="neither an `opdkit train --out` directory"):
        train_dirs([tmp_path])


NO_CONTROLS = "pipeline.controls=[]"


def test_pipeline_matrix_and_run_patterns():
    cfg = load_config(None, ["loss.name=jsd", "pipeline.baseline_arm=rkl", "pipeline.seeds=[3, 1]", NO_CONTROLS])
    assert pipeline_matrix(cfg) == [("jsd", 3), ("jsd", 1), ("rkl", 3), ("rkl", 1)]
    # one arm when they agree
    assert pipeline_matrix(load_config(None, ["pipeline.seeds=[0]", NO_CONTROLS])) == [("rkl", 0)]
    got = expand_runs(["ref.json", "e/{arm}/seed{seed}.json", "t/{arm}"], cfg)
    assert got == [Path("ref.json"), *(Path(f"e/{a}/seed{s}.json") for a in ("jsd", "rkl") for s in (3, 1)),
                   Path("t/jsd"), Path("t/rkl")]  # a pattern without {seed}: once per arm
    with pytest.raises(ValueError, match=r"run pattern 'e/\{arm\}/\{run\}': only \{arm\} and \{seed\}"):
        expand_runs(["e/{arm}/{run}"], cfg)


def test_pipeline_arms_are_the_opd_arms_then_the_controls_with_their_budgets():
    cfg = load_config(ROOT / "params.yaml")
    arms = pipeline_arms(cfg)
    assert [a.name for a in arms] == ["rkl", "sft_teacher", "sft_reference"]
    assert arms[0].steps == cfg.budget.max_steps and arms[0].match == "baseline"
    sft_t, sft_r = arms[1], arms[2]
    assert "loss.sft_source=teacher" in sft_t.overrides and "loss.sft_source=reference" in sft_r.overrides
    assert sft_r.steps == cfg.budget.max_steps and sft_r.match == "steps" and sft_t.match == "wall"
    # dvc.yaml's train stage trains exactly these arms: its driver builds each run's -S from them
    import yaml

    from opdkit.stages.train_runs import train_jobs

    assert "opdkit.stages.train_runs" in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["cmd"]
    argv = {j.name: j.argv for j in train_jobs(str(ROOT / "params.yaml"), "S", "T", "D", "runs/train", "logs")}
    for arm in arms:
        assert all(o in argv[f"{arm.name}/seed0"] for o in arm.overrides), arm.name
    with pytest.raises(ConfigError, match=r"arm name\(s\) \['rkl'\] repeat"):
        pipeline_arms(load_config(None, ["pipeline.controls=[{name: rkl}]"]))
    with pytest.raises(ConfigError, match="reserved"):
        pipeline_arms(load_config(None, ["pipeline.controls=[{name: before}]"]))
    with pytest.raises(ConfigError, match="match must be one of steps, wall"):
        load_config(None, ["pipeline.controls=[{name: x, match: flops}]"])


def test_learning_curves_average_each_step_over_seeds(tmp_path):
    pts = {0: [(60, 30.0, 900, 0.40), (120, 61.0, 1800, 0.50)], 1: [(60, 32.0, 1000, 0.44), (120, 66.0, 2100, 0.56)]}
    files = []
    for seed, rows in pts.items():
        f = tmp_path / f"c{seed}.json"
        f.write_text(json.dumps({"arm": "rkl", "seed": str(seed), "points": [
            {"step": st, "elapsed_s": e, "tokens": t, "accuracy": a, "stderr": 0.02} for st, e, t, a in rows]}))
        files.append(f)
    before = write_eval(tmp_path / "before.json", "before", None, 0.30, stderr=0.025)
    (start, p60, p120), = learning_curves(files, before=before).values()
    assert start == {"step": 0, "mean": 0.30, "se": 0.025, "n": 1, "elapsed_s": 0.0, "elapsed_s_se": 0.0, "tokens": 0}
    assert p120["step"] == 120 and p120["n"] == 2 and p120["mean"] == pytest.approx(0.53)
    assert p120["se"] == pytest.approx(np.std([0.50, 0.56], ddof=1) / math.sqrt(2))
    assert p60["elapsed_s"] == pytest.approx(31.0) and p60["tokens"] == pytest.approx(950)
    assert p60["elapsed_s_se"] == pytest.approx(np.std([30.0, 32.0], ddof=1) / math.sqrt(2))
    with pytest.raises(ValueError, match="is not a curve.json"):
        learning_curves([before])


def test_training_seconds_come_from_the_checkpoints_and_a_wall_match_off_by_over_10pc_is_flagged(tmp_path):
    """An eval of a published checkpoint reads its opdkit.json's elapsed_s; a wall-matched arm that trained
    more than 10% longer or shorter than the baseline is flagged, one within 10% and a steps-matched one are not."""
    from opdkit.persist.checkpoints import MANIFEST
    from opdkit.studies.report import CHECKPOINT_META, WALL_MATCH_TOL

    assert CHECKPOINT_META == MANIFEST and WALL_MATCH_TOL == 0.10
    secs = {"rkl": [138.0, 140.0], "sft_teacher": [210.0, 212.0], "close": [150.0, 151.0], "sft_reference": [14.0,
                                                                                                             15.0]}
    match = {"sft_teacher": "wall", "close": "wall", "sft_reference": "steps", "rkl": "steps"}
    paths = []
    for arm, ss in secs.items():
        for seed, elapsed in enumerate(ss):
            ck = tmp_path / "train" / arm / f"seed{seed}" / "checkpoints" / "checkpoint-120"
            ck.mkdir(parents=True)
            (ck / MANIFEST).write_text(json.dumps({"step": 120, "elapsed_s": elapsed}))
            paths.append(write_eval(tmp_path / "eval" / arm / f"seed{seed}.json", arm, seed, 0.9 + 0.01 * seed,
                                    model=str(ck), step="120", match=match[arm]))
    paths.append(write_eval(tmp_path / "eval" / "before.json", "before", None, 0.4, model=str(tmp_path / "nothing")))
    r = report(paths, baseline="rkl")
    g = r["groups"]
    assert g["rkl"]["train_s"] == 139.0 and g["sft_teacher"]["train_s"] == 211.0 and g["before"]["train_s"] is None
    assert g["sft_teacher"]["train_s_ratio"] == pytest.approx(211 / 139) and g["rkl"]["train_s_ratio"] == 1.0
    assert set(r["wall_mismatch"]) == {"sft_teacher"}  # close: x1.08; sft_reference: matched by steps
    assert "211 s against 139 s (x1.52" in r["wall_mismatch"]["sft_teacher"]
    table = format_report(r)
    assert re.search(r"^sft_teacher\s+120\s+211 wall ", table, re.M) and "WARNING: sft_teacher is matched" in table
    assert re.search(r"^before\s+n/a|^before\s{10,}", table, re.M)


def test_each_comparison_lists_what_the_arm_changed_and_flags_runs_not_trained_alike(tmp_path):
    """changes: the settings (the checkpoints' params, flattened, less seed and run names; with their data
    fingerprint) an arm was trained with otherwise than the baseline. A warning where an arm's own seeds were
    trained otherwise than each other, or on other data than the baseline; the code revisions are listed per group,
    not compared (any commit changes them); evals of models that are no checkpoints of opdkit train have no
    changes."""
    from opdkit.persist.checkpoints import MANIFEST

    def params(loss, lr, seed):
        return {"seed": seed, "experiment_name": f"{loss}{seed}", "loss": {"name": loss, "clip": "none"},
                "optim": {"lr": lr}, "pipeline": {"seeds": [0, 1]}, "runtime": {"state_dir": f"/s/{loss}{seed}"}}

    runs = {("rkl", 0): (params("rkl", 1e-4, 0), "d1"), ("rkl", 1): (params("rkl", 1e-4, 1), "d1"),
            ("jsd", 0): (params("jsd", 1e-4, 0), "d1"), ("jsd", 1): (params("jsd", 1e-4, 1), "d1"),
            ("bundled", 0): (params("jsd", 5e-4, 0), "d1"), ("bundled", 1): (params("jsd", 1e-3, 1), "d2")}
    paths = []
    for (arm, seed), (p, data) in runs.items():
        ck = tmp_path / arm / str(seed)
        ck.mkdir(parents=True)
        (ck / MANIFEST).write_text(json.dumps({"params": p, "code_revision": f"rev{seed}", "data_fingerprint": data}))
        paths.append(write_eval(tmp_path / "eval" / f"{arm}{seed}.json", arm, seed, 0.5 + 0.01 * seed, model=str(ck)))
    paths += [write_eval(tmp_path / "eval" / f"hub{i}.json", "hub", i, 0.4 + 0.01 * i, model="/nowhere")
              for i in (0, 1)]
    r = report(paths, baseline="rkl")
    c = r["comparisons"]
    assert c["jsd"]["changes"] == {"loss.name": ["rkl", "jsd"]}  # seed, names and paths are not settings
    assert c["bundled"]["changes"] == {"loss.name": ["rkl", "jsd"]}  # what its seeds share; the rest is flagged:
    assert r["confounds"]["bundled"] == "bundled's runs were not trained alike: data_fingerprint 'd1', 'd2'; " \
                                        "optim.lr 0.0005, 0.001"
    assert c["hub"]["changes"] is None and set(r["confounds"]) == {"bundled"}
    assert r["groups"]["jsd"]["code_revisions"] == ["rev0", "rev1"] and r["groups"]["hub"]["code_revisions"] == []
    table = format_report(r)
    assert "jsd vs rkl: loss.name 'rkl' -> 'jsd'" in table and "WARNING: bundled's runs were not trained alike" in table
    again = report([p for p in paths if "bundled" not in str(p) and "hub" not in str(p)], baseline="jsd")
    assert again["comparisons"]["rkl"]["changes"] == {"loss.name": ["jsd", "rkl"]}
    for seed in (0, 1):
        (tmp_path / "jsd" / str(seed) / MANIFEST).write_text(json.dumps(
            {"params": params("jsd", 1e-4, seed), "code_revision": "x", "data_fingerprint": "d3"}))
    other = report(paths[:4], baseline="rkl")
    assert other["comparisons"]["jsd"]["changes"] == {"data_fingerprint": ["d1", "d3"], "loss.name": ["rkl", "jsd"]}
    assert other["confounds"]["jsd"].startswith("jsd was trained on other data (data_fingerprint) than rkl")
    same = report([p for p in paths if "rkl" in str(p)] + [
        write_eval(tmp_path / "eval" / f"rerun{i}.json", "rerun", i, 0.51, model=str(tmp_path / "rkl" / str(i)))
        for i in (0, 1)], baseline="rkl")
    assert same["comparisons"]["rerun"]["changes"] == {}
    assert "rerun vs rkl: trained alike (the same settings and data)" in format_report(same)
    lost = report(paths[:4] + [write_eval(tmp_path / "eval" / "jsd2.json", "jsd", 2, 0.52, model="/moved")],
                  baseline="rkl")
    assert lost["confounds"]["jsd"].startswith("jsd: 1 of its runs evaluated a model with no opdkit.json (not a "
                                               "checkpoint of opdkit train, or moved): what they were trained with is "
                                               "not compared; jsd was trained on other data")  # (d3 since above)
    assert lost["comparisons"]["jsd"]["changes"] == {"data_fingerprint": ["d1", "d3"], "loss.name": ["rkl", "jsd"]}


def test_a_stray_run_folder_does_not_change_the_report(evals, tmp_path, capsys):
    """Outputs of a seed or an arm that params.yaml no longer lists stay under runs/ (DVC leaves them):
    the pipeline's pattern reads only the listed ones, so the report is the same with them there."""
    params = tmp_path / "params.yaml"
    params.write_text("loss:\n  name: jsd\npipeline:\n  seeds: [0, 1, 2]\n  baseline_arm: rkl\n  controls: []\n")
    pattern = str(evals / "{arm}" / "seed{seed}.json")
    argv = ["report", pattern, str(evals / "reference" / "before.json"), "--baseline", "rkl", "-p", str(params)]
    assert main(argv) == 0
    clean = json.loads(capsys.readouterr().out)
    write_eval(evals / "jsd" / "seed3.json", "jsd", 3, 0.99)  # a dropped seed
    write_eval(evals / "k1" / "seed0.json", "k1", 0, 0.99)  # a dropped arm
    for d in ("jsd", "rkl"):
        (tmp_path / "train" / d / "seed9" / "metrics").mkdir(parents=True)
        (tmp_path / "train" / d / "seed9" / "metrics" / "train.jsonl").write_text('{"step": 1}\n')
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == clean
    assert clean["groups"]["jsd"]["n"] == 3 and set(clean["groups"]) == {"before", "jsd", "rkl"}
    assert report([evals / "jsd", evals / "rkl"])["groups"]["jsd"]["n"] == 4  # a folder counts all it holds
    # -S, as with every command; the training runs the same way
    assert main([*argv, "-S", "pipeline.seeds=[0, 1]"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"]["jsd"]["seeds"] == [0, 1]
    for s in (0, 1, 2):
        (tmp_path / "train" / "jsd" / f"seed{s}" / "metrics").mkdir(parents=True)
        (tmp_path / "train" / "jsd" / f"seed{s}" / "metrics" / "train.jsonl").write_text('{"step": 1}\n')
    runs = train_dirs(expand_runs([tmp_path / "train" / "{arm}" / "seed{seed}"], load_config(None, [
        "loss.name=jsd", "pipeline.baseline_arm=jsd", NO_CONTROLS])))
    assert [d.name for d in runs] == ["seed0", "seed1", "seed2"]
    assert main(["report", pattern, "-p", str(params), "-S", "pipeline.seeds=[5]"]) == 2
    assert "seed5.json does not exist" in capsys.readouterr().err


# --- inspection -------------------------------------------------------------------------------


def test_tokens_html_escapes_and_colours():
    h = tokens_html(["<b>", "x"], [-3.0, 0.5], scale=2.0)
    assert "&lt;b&gt;" in h and "<b>" not in h
    assert "rgba(220, 40, 40, 1.00)" in h and "rgba(40, 160, 60, 0.25)" in h and 'title="-3.000"' in h
    assert delta_colour(0.0, 2.0).endswith("0.00)")
    with pytest.raises(ValueError, match="2 tokens but 1 values"):
        tokens_html(["a", "b"], [0.0])


def test_inspect_rollouts_scores_every_sampled_token(tok, tiny_llama):
    prompts = [tok("Compute 2+3.").input_ids, tok("Compute 10-4.").input_ids]
    kw = dict(seed=0, temperature=1.0, top_p=1.0, max_new_tokens=12)
    same = inspect_rollouts(tiny_llama, tiny_llama, tok, prompts, **kw)
    assert len(same) == 2
    for s in same:
        assert len(s.tokens) == len(s.logp_student) == len(s.logp_teacher) > 0
        assert all(d == 0.0 for d in s.delta)  # teacher == student: identical scoring, delta exactly 0
        assert all(lp <= 0 for lp in s.logp_student)
    torch.manual_seed(1)
    other = type(tiny_llama)(tiny_llama.config).eval()
    diff = inspect_rollouts(tiny_llama, other, tok, prompts, **kw)
    assert [s.tokens for s in diff] == [s.tokens for s in same]  # sampling depends on the student and seeds only
    assert [s.logp_student for s in diff] == [s.logp_student for s in same]
    m = summary(diff)
    deltas = [d for s in diff for d in s.delta]
    assert m["n_tokens"] == len(deltas) and m["mean_delta"] == pytest.approx(np.mean(deltas)) and m["min_delta"] < 0

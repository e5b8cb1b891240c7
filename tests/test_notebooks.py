"""Every analysis notebook, executed by papermill on small inputs, and the metrics JSON it writes;
then each executed notebook opened in JupyterLab in headless Chromium (the last test).

A module fixture makes real inputs once: two 3-step training runs of the shipped student and their
evals (plus the student before training and the teacher), on a few eval questions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from opdkit.cli import main
from opdkit.config import load_config
from opdkit.embedded import asset
from opdkit.stages import eval_checkpoints
from opdkit.stats import paired_question_diff
from opdkit.studies.report import per_question_correct, report, train_metrics
from opdkit.train import train

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SEEDS = (0, 1)
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=16",
        "budget.max_steps=3", "budget.max_wall_time_s=0", "optim.schedule=cosine", "publish.every_steps=2",
        "runtime.threads=1"]
EVAL = ["eval.n_samples=2", "eval.max_new_tokens=16", "eval.max_questions=6", "runtime.threads=1"]

pytestmark = pytest.mark.slow  # each notebook starts a kernel and imports torch (~10 s)
# notebook name -> its executed copy (execute() records it; the JupyterLab test opens it)
EXECUTED: dict[str, Path] = {}


def execute(name: str, workdir: Path, **parameters) -> dict:
    """Run notebooks/<name>.ipynb with papermill in ``workdir`` (the executed copy goes there too);
    return the metrics JSON it wrote into its ``out_dir`` parameter."""
    import papermill

    papermill.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(workdir / f"{name}.ipynb"),
                               parameters=parameters, kernel_name="python3", progress_bar=False, cwd=str(workdir))
    EXECUTED[name] = workdir / f"{name}.ipynb"
    metrics_name = "notebook_metrics.json" if name.startswith("study_") else "metrics.json"
    return json.loads((Path(parameters["out_dir"]) / metrics_name).read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nb_runs")
    for seed in SEEDS:
        train(load_config(None, [*TINY, f"seed={seed}"]), root / "train" / f"seed{seed}", log=lambda *a: None,
              progress=False)
        assert eval_checkpoints.main(["--run", str(root / "train" / f"seed{seed}"), "--steps", "3",
                                      "--data", str(asset("eval")),
                                      "--out", str(root / "eval" / "rkl" / f"seed{seed}.json"),
                                      "--curve-dir", str(root / "curves" / "rkl" / f"seed{seed}"), "--tag", "arm=rkl",
                                      "--tag", f"seed={seed}", "-p", "none", *sum((["-S", s] for s in EVAL), [])]) == 0
    for arm, model in (("before", asset("student")), ("teacher", asset("teacher"))):
        assert main(["eval", "--model", str(model), "--out", str(root / "eval" / "reference" / f"{arm}.json"),
                     "--tag", f"arm={arm}", "--quiet", *sum((["-S", s] for s in EVAL), [])]) == 0
    return root


def test_every_notebook_has_one_parameters_cell_and_is_tested():
    import nbformat  # (here, not at the top: importing it takes ~1.2 s, jsonschema's IRI grammar, in every worker)

    tested = {"training_dynamics", "eval_comparison", "repeat_runs", "rollout_inspection", "study_padding",
              "study_clipped_mass"}
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == tested
    for p in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(p, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{p.name}: {len(tagged)} parameters cells"
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "from opdkit" in code and "\ndef " not in "\n" + code, f"{p.name}: define functions in opdkit"
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{p.name} is saved with outputs"


def test_papermill_reads_every_parameter(caplog):
    """papermill parses each line of a parameters cell (one '=' per line, comments included); a line it
    cannot parse is logged, and a value passed for it is 'an unknown parameter'."""
    import ast
    import logging

    import nbformat
    import papermill

    for p in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(p, as_version=4)
        (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assigned = [t.id for node in ast.parse(cell.source).body for t in node.targets]
        with caplog.at_level(logging.WARNING, logger="papermill"):
            caplog.clear()
            inferred = papermill.inspect_notebook(str(p))
        assert list(inferred) == assigned and not caplog.records, f"{p.name}: {caplog.text}"


def test_notebooks_opened_from_the_notebooks_folder_read_the_listed_runs(runs, tmp_path):
    """By hand in JupyterLab: the working directory is notebooks/ and no parameter is passed. The defaults
    (relative to the project root: runs/..., params.yaml) still resolve, and a stray run folder (a seed no
    longer in params.yaml) is not counted."""
    import shutil

    import yaml

    root = tmp_path / "project"
    (root / "notebooks").mkdir(parents=True)
    (root / "dvc.yaml").write_text("stages: {}\n")
    (root / "params.yaml").write_text(yaml.safe_dump({"loss": {"name": "rkl"},
                                                      "pipeline": {"seeds": list(SEEDS), "baseline_arm": "rkl",
                                                                   "controls": []}}))
    shutil.copytree(runs / "eval", root / "runs" / "eval")
    for seed in SEEDS:
        shutil.copytree(runs / "train" / f"seed{seed}", root / "runs" / "train" / "rkl" / f"seed{seed}")
    stray_run = root / "runs" / "train" / "rkl" / "seed7"  # a dropped seed
    shutil.copytree(runs / "train" / "seed1", stray_run)
    (stray_run / "config.yaml").write_text(yaml.safe_dump(yaml.safe_load((stray_run / "config.yaml").read_text())
                                                          | {"seed": 7}))
    stray = json.loads((runs / "eval" / "rkl" / "seed1.json").read_text()) | {"seed": "7", "accuracy": 1.0}
    (root / "runs" / "eval" / "rkl" / "seed7.json").write_text(json.dumps(stray))
    shutil.copy(root / "runs" / "eval" / "rkl" / "seed1.jsonl", root / "runs" / "eval" / "rkl" / "seed7.jsonl")

    import papermill

    for name in ("repeat_runs", "training_dynamics"):
        papermill.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(tmp_path / f"{name}.ipynb"), parameters={},
                                   kernel_name="python3", progress_bar=False, cwd=str(root / "notebooks"))
    m = json.loads((root / "runs" / "notebooks" / "repeat_runs" / "metrics.json").read_text())
    ref = report([runs / "eval" / "rkl" / f"seed{s}.json" for s in SEEDS], baseline="rkl")
    assert m["groups"]["rkl"]["n"] == 2 and m["groups"]["rkl"]["mean"] == pytest.approx(ref["groups"]["rkl"]["mean"])
    m = json.loads((root / "runs" / "notebooks" / "training_dynamics" / "metrics.json").read_text())
    assert m["n_runs"] == 2 and set(m["runs"]) == {"rkl seed 0", "rkl seed 1"}
    assert not (root / "notebooks" / "runs").exists()  # nothing written relative to notebooks/


def test_training_dynamics(runs, tmp_path):
    m = execute("training_dynamics", tmp_path, runs=[str(runs / "train")], out_dir=str(tmp_path / "out"))
    assert m["n_runs"] == 2 and set(m["runs"]) == {"rkl seed 0", "rkl seed 1"}
    rows = train_metrics(runs / "train" / "seed1")
    got = m["runs"]["rkl seed 1"]
    assert got["steps"] == 3 and got["kl_first10"] == pytest.approx(sum(r["kl"] for r in rows) / 3)
    assert (tmp_path / "out" / "training_dynamics.png").stat().st_size > 10_000


def test_eval_comparison(runs, tmp_path):
    ev = runs / "eval"
    curves = [str(runs / "curves" / "rkl" / f"seed{s}" / "curve.json") for s in SEEDS]
    m = execute("eval_comparison", tmp_path, before=str(ev / "reference" / "before.json"),
                teacher=str(ev / "reference" / "teacher.json"), after=[str(ev / "rkl")], curves=curves,
                out_dir=str(tmp_path / "out"))
    before = json.loads((ev / "reference" / "before.json").read_text())
    teacher = json.loads((ev / "reference" / "teacher.json").read_text())
    after = [json.loads((ev / "rkl" / f"seed{s}.json").read_text())["accuracy"] for s in SEEDS]
    assert m["before_accuracy"] == before["accuracy"] and m["teacher_accuracy"] == teacher["accuracy"]
    assert m["after_mean_accuracy"] == pytest.approx(sum(after) / 2)
    ref = paired_question_diff(per_question_correct(ev / "rkl" / "seed1.json"),
                               per_question_correct(ev / "reference" / "before.json"))
    assert m["after_minus_before"]["rkl seed 1"]["diff"] == pytest.approx(ref["diff"])
    assert (tmp_path / "out" / "eval_comparison.png").is_file()
    # learning curve: the student before training at step 0, then each kept checkpoint (2, and the final 3)
    start, mid, end = m["curves"]["rkl"]
    assert (start["step"], start["mean"], start["se"], start["tokens"]) == (0, before["accuracy"], before["stderr"], 0)
    mids = [json.loads((runs / "curves" / "rkl" / f"seed{s}" / "checkpoint-2.json").read_text())["accuracy"]
            for s in SEEDS]
    assert mid["step"] == 2 and mid["n"] == 2 and mid["mean"] == pytest.approx(sum(mids) / 2)
    assert end["step"] == 3 and end["mean"] == pytest.approx(sum(after) / 2)
    tokens = [sum(r["tokens"] for r in train_metrics(runs / "train" / f"seed{s}")) for s in SEEDS]
    assert end["tokens"] == pytest.approx(sum(tokens) / 2)
    assert (tmp_path / "out" / "learning_curves.png").stat().st_size > 10_000


def test_repeat_runs(runs, tmp_path):
    ev = runs / "eval"
    m = execute("repeat_runs", tmp_path, evals=[str(ev / "rkl"), str(ev / "reference" / "before.json")],
                baseline="rkl", out_dir=str(tmp_path / "out"))
    ref = report([ev / "rkl", ev / "reference" / "before.json"], baseline="rkl")
    assert m["groups"]["rkl"]["n"] == 2 and m["groups"]["rkl"]["mean"] == pytest.approx(ref["groups"]["rkl"]["mean"])
    assert m["groups"]["rkl"]["se"] == pytest.approx(ref["groups"]["rkl"]["se"])
    assert m["comparisons"] == {}  # `before` has one run: summarised, not compared
    assert (tmp_path / "out" / "repeat_runs.png").is_file()


def test_rollout_inspection(runs, tmp_path):
    after = runs / "train" / "seed0" / "checkpoints" / "checkpoint-3"
    m = execute("rollout_inspection", tmp_path, students={"after": str(after), "teacher": str(asset("teacher"))},
                teacher=str(asset("teacher")), data=str(asset("eval")), n_prompts=3, params_file="none.yaml",
                overrides=["runtime.threads=1", "rollout.max_new_tokens=24"], out_dir=str(tmp_path / "out"))
    assert m["after"]["n_samples"] == 3 and 0 < m["after"]["n_tokens"] <= 3 * 24
    assert m["after"]["mean_delta"] < 0  # the teacher disagrees with some of what the student samples
    assert m["teacher"]["mean_delta"] == 0.0 and m["teacher"]["min_delta"] == 0.0  # a model scored against itself
    html = (tmp_path / "rollout_inspection.ipynb").read_text()
    assert "background:rgba(" in html  # the coloured tokens are in the executed notebook
    assert (tmp_path / "out" / "token_delta.png").is_file()


def test_study_padding_notebook_runs_the_study(tmp_path):
    m = execute("study_padding", tmp_path, out_dir=str(tmp_path / "out"), params_file="none.yaml",
                overrides=["studies.n_prompts=3", "studies.samples_per_prompt=1", "studies.padding_k=[0, 4]",
                           "rollout.max_new_tokens=16", "runtime.threads=1"])
    assert m["kl_right_k0"] == 0.0 and m["alignment_passed"] is True
    assert m["kl_left_max_abs"] < 1e-4 and m["signal_kl"] > 0
    assert (tmp_path / "out" / "padding.json").is_file() and (tmp_path / "out" / "padding_kl.png").is_file()


def test_study_clipped_mass_notebook_runs_the_study(tmp_path):
    m = execute("study_clipped_mass", tmp_path, out_dir=str(tmp_path / "out"), params_file="none.yaml",
                overrides=["studies.n_prompts=3", "studies.samples_per_prompt=1", "studies.clip_tau=[0.0, 0.05, .inf]",
                           "rollout.max_new_tokens=16", "runtime.threads=1"])
    assert m["clipped_mass"]["inf"] == 0.0 and m["clipped_mass"]["0.0"] > 0
    assert m["grad_cosine"]["inf"] == pytest.approx(1.0, abs=1e-5) and m["n_positions"] > 0
    assert not math.isnan(m["kl_mean"])


def test_executed_notebooks_render_in_jupyterlab(runs, tmp_path):
    """As a person opens them: `jupyter lab` (loopback, a token) and headless Chromium (tests/lab_browser.py).
    Each notebook the tests above executed (executed here first where they did not run) shows every figure
    its file holds, each decoded and not blank (pixel spread of the rendered <img>), and no error output;
    a control notebook with an error output and a blank figure shows the checks catch both. Screenshots
    are saved under this test's tmp_path/screenshots."""
    import shutil

    from playwright.sync_api import sync_playwright

    import lab_browser

    chromium = lab_browser.browser()  # skips, saying why, where there is no browser
    again = {"training_dynamics": lambda d: test_training_dynamics(runs, d),
             "eval_comparison": lambda d: test_eval_comparison(runs, d),
             "repeat_runs": lambda d: test_repeat_runs(runs, d),
             "rollout_inspection": lambda d: test_rollout_inspection(runs, d),
             "study_padding": test_study_padding_notebook_runs_the_study,
             "study_clipped_mass": test_study_clipped_mass_notebook_runs_the_study}
    root, shots = tmp_path / "lab", tmp_path / "screenshots"
    root.mkdir()
    shots.mkdir()
    for name, run_its_test in again.items():
        if name not in EXECUTED:  # this test alone (-k): its notebook test executes it
            (tmp_path / name).mkdir()
            run_its_test(tmp_path / name)
        shutil.copy(EXECUTED[name], root / f"{name}.ipynb")
    lab_browser.control_notebook(root / "control.ipynb")
    with lab_browser.jupyter_lab(root, tmp_path) as (base, token), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for name in again:
            nb = root / f"{name}.ipynb"
            seen = lab_browser.check_notebook(page, base, token, nb, nb.name)
            (shots / f"{name}.png").write_bytes(seen.screenshot)
            assert seen.figures == lab_browser.figures_in(nb) >= 1, name
            assert min(seen.spreads) > 5, (name, seen.spreads)  # a blank image has a spread of 0
            assert seen.error_outputs == 0 and lab_browser.errors_in(nb) == [], name
        seen = lab_browser.check_notebook(page, base, token, root / "control.ipynb", "control.ipynb")
        assert (seen.figures, seen.spreads, seen.error_outputs) == (1, [0.0], 1)
        browser.close()

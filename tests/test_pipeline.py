"""The DVC pipeline (dvc.yaml): its declarations, the data-subset stage, the train and eval stages' jobs,
and a real `dvc repro` on tiny params in a temporary copy of the repository (slow): outputs, a second
repro that does nothing, a loss param that invalidates only the training stage, strays removed, a run
trained again from scratch giving the same metrics while the others are reused, each stage
importing only opdkit code it declares as a dependency, and the runs' training and learning curves in
`dvc plots show`, their final metrics in `dvc metrics show` and `dvc exp show`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opdkit.config import ConfigError, parse_override
from opdkit.data import fingerprint, load_examples
from opdkit.stages import subset

ROOT = Path(__file__).resolve().parents[1]
# package __init__s that hold only a docstring (and __version__): imported by every stage below them
NOT_A_CODE_DEP = {"opdkit/__init__.py", "opdkit/stages/__init__.py"}


def _stages(root: Path):
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return [(st.name, st.cmd, list(st.deps)) for st in repo.index.stages]


def test_every_declared_dep_and_param_exists_and_no_path_is_absolute():
    stages = _stages(ROOT)
    names = {name.split("@")[0] for name, _, _ in stages}
    assert {"embedded", "data", "offline_rollouts", "train", "eval", "report", "study_padding", "study_clipped_mass",
            "nb_training_dynamics", "nb_eval_comparison", "nb_repeat_runs", "nb_rollout_inspection",
            "nb_study_padding", "nb_study_clipped_mass"} <= names
    for name, cmd, deps in stages:
        absolute = [w for w in cmd.replace("=", " ").replace(":", " ").split() if w.lstrip("\"'{[").startswith("/")]
        assert not absolute and not any(Path(d.def_path).is_absolute() for d in deps), f"stage {name}: {absolute}"
        for d in deps:
            if type(d).__name__ == "ParamsDependency":
                for key in d.params:
                    try:
                        parse_override(f"{key}=0")  # checks that the dotted key exists
                    except ConfigError as e:
                        raise AssertionError(f"stage {name}: params key {key!r} is not a config key: {e}") from None
            elif d.def_path.startswith(("opdkit/", "notebooks/")):
                assert (ROOT / d.def_path).exists(), f"stage {name}: code dep {d.def_path} does not exist"


# what a stage command that builds a run config (params < recipe < -S) looks like
BUILDS_A_CONFIG = ("opdkit train ", "opdkit eval ", "opdkit study ", "opdkit offline-rollouts ",
                   "python -m opdkit.stages.subset ",
                   "python -m opdkit.stages.train_runs ", "python -m opdkit.stages.eval_runs ",
                   "notebooks/rollout_inspection.ipynb ")


def test_stages_that_build_a_config_pin_the_recipe():
    """Each such stage lists the `recipe` key among its params and the recipe file among its deps (so
    dvc.lock records which recipe and its hash); the pipeline's default recipe changes nothing."""
    from opdkit.config import load_config as load_as_is
    from opdkit.recipes import load_config

    recipe = yaml.safe_load((ROOT / "params.yaml").read_text())["recipe"]
    assert recipe and (ROOT / recipe).is_file() and not Path(recipe).is_absolute()
    assert load_config(ROOT / "params.yaml") == load_as_is(ROOT / "params.yaml")  # recipes/embedded.yaml: empty
    pinned = set()
    for name, cmd, deps in _stages(ROOT):
        keys = {k for d in deps if type(d).__name__ == "ParamsDependency" for k in d.params}
        files = {d.def_path for d in deps if type(d).__name__ != "ParamsDependency"}
        builds = any(marker in cmd + " " for marker in BUILDS_A_CONFIG)
        assert builds == ("recipe" in keys) == (recipe in files), f"stage {name}: builds a config {builds}, {keys}"
        if builds:
            assert "opdkit/recipes.py" in files, name
            pinned.add(name.split("@")[0])
    assert pinned == {"data", "offline_rollouts", "train", "eval", "study_padding", "study_clipped_mass",
                      "nb_rollout_inspection"}


def test_every_seed_and_arm_gets_a_run_and_its_evals(tmp_path):
    """The train stage's jobs: each arm (loss.name, the baseline, the controls) x seed, with the command
    dvc.yaml ran per run before; the eval stage's: the two references and each kept checkpoint of a run."""
    from opdkit.stages.eval_runs import eval_jobs
    from opdkit.stages.train_runs import train_jobs

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    arms = list(dict.fromkeys([params["loss"]["name"], params["pipeline"]["baseline_arm"]]))
    seeds = params["pipeline"]["seeds"]
    assert len(seeds) >= 3
    # deterministic runs: a step horizon (the evals read checkpoint-<max_steps>), no wall clock, a step schedule
    assert params["budget"]["max_steps"] > 0 and params["budget"]["max_wall_time_s"] == 0
    assert params["optim"]["schedule"] in ("constant", "linear", "cosine")
    # the controls: sft on teacher samples and on reference solutions, each over the seeds
    controls = params["pipeline"]["controls"]
    assert {c["sft_source"] for c in controls} == {"teacher", "reference"}
    for c in controls:
        assert c["match"] in ("steps", "wall") and (c["match"] == "wall" or c["steps"] == params["budget"]["max_steps"])
        assert c["steps"] // c["every_steps"] <= params["publish"]["keep"]  # every curve checkpoint is kept
    jobs = train_jobs(str(ROOT / "params.yaml"), "S", "T", "D.parquet", "runs/train", "logs")
    names = [f"{a}/seed{s}" for a in arms + [c["name"] for c in controls] for s in seeds]
    assert [j.name for j in jobs] == names and [j.outputs for j in jobs] == [(f"runs/train/{n}",) for n in names]
    by_name = {j.name: " ".join(j.argv) for j in jobs}
    for seed in seeds:
        assert f"-S seed={seed} -S loss.name={arms[0]} -S experiment_name={arms[0]} -S student.path=S " \
               "-S teacher.path=T -S data.train=D.parquet" in by_name[f"{arms[0]}/seed{seed}"]
        for c in controls:
            assert (f"-S seed={seed} -S loss.name=sft -S loss.sft_source={c['sft_source']} -S teacher.source=model "
                    "-S data.pad_side=left -S loss.reward_weight=0 -S rollout.source=live -S "
                    f"budget.max_steps={c['steps']} "
                    f"-S publish.every_steps={c['every_steps']} "
                    f"-S experiment_name={c['name']}") in by_name[f"{c['name']}/seed{seed}"]
    # the evals: every kept checkpoint of every run (fake runs here), the last one into runs/eval
    for arm in arms + controls:
        name, steps = (arm, params["budget"]["max_steps"]) if isinstance(arm, str) else (arm["name"], arm["steps"])
        for seed in seeds:
            for k in (1, 2, 3):
                (tmp_path / "train" / name / f"seed{seed}" / "checkpoints" / f"checkpoint-{k * steps // 3}").mkdir(
                    parents=True)
    ejobs, curves = eval_jobs(str(ROOT / "params.yaml"), str(tmp_path / "train"), "S", "T", "E.parquet", "ev", "cu",
                              "logs")
    outs = [j.outputs[0] for j in ejobs]
    assert sorted(o for o in outs if o.startswith("ev/")) == sorted(
        ["ev/reference/before.json", "ev/reference/teacher.json"] + [f"ev/{n}.json" for n in names])
    assert len([o for o in outs if o.startswith("cu/")]) == 2 * len(names) and len(curves) == len(names)
    assert all(" --tag arm=" in " ".join(j.argv) for j in ejobs)


def test_subset_stage_selects_like_the_commands_and_pins_a_fingerprint(tmp_path):
    rows = [{"id": str(i), "prompt": f"Compute {i}+1.", "answer": str(i + 1) if i % 3 else f"{i}.5",
             "solution": "x" * i, "source": "a" if i % 2 else "b"} for i in range(12)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"filters": {"answer_regex": r"-?\d{1,6}", "exclude_sources": ["b"]},
                                               "max_rows": 3}}))
    out = tmp_path / "out"
    argv = ["--train", str(src), "--eval", str(src), "--out-train", str(out / "train.parquet"),
            "--out-eval", str(out / "eval.parquet"), "--info", str(out / "subset.json"), "-p", str(params)]
    assert subset.main(argv) == 0
    info = json.loads((out / "subset.json").read_text())
    from opdkit.config import load_config

    data_cfg = load_config(params).data
    chosen = load_examples(src, data_cfg)
    assert [ex.id for ex in chosen] == ["1", "5", "7"]  # odd ids (source a), integer answers, first 3
    got = load_examples(out / "train.parquet", data_cfg)
    assert got == chosen and info["train"]["rows"] == 3 and info["train"]["fingerprint"] == fingerprint(chosen)
    first = (out / "train.parquet").read_bytes()
    assert subset.main(argv) == 0 and (out / "train.parquet").read_bytes() == first  # same bytes again


# --- a real `dvc repro` on tiny params -------------------------------------------------------------

TINY = {
    "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 16},
    "budget": {"max_steps": 3, "max_wall_time_s": 0.0},
    "publish": {"every_steps": 2},
    "eval": {"n_samples": 2, "max_new_tokens": 48, "max_questions": 6},
    "runtime": {"threads": 1},
    "studies": {"n_prompts": 3, "samples_per_prompt": 1, "padding_k": [0, 2], "clip_tau": [0.0, 0.1, ".inf"]},
    "pipeline": {"seeds": [0, 1],  # one control (each stage starts a process): its own step budget and spacing
                 "controls": [{"name": "sft_reference", "sft_source": "reference", "steps": 4, "every_steps": 2,
                               "match": "wall"}]},
}

# Logs, per DVC stage (DVC sets DVC_STAGE for each command; notebook kernels inherit it), each opdkit
# module its processes import, as it is imported (kernels may end without running atexit handlers).
SITECUSTOMIZE = '''
import os, sys
# (not a log: jsonschema, which papermill imports through nbformat in each notebook stage, builds the grammar of
# rfc3987-syntax, where that is installed, for its 'iri' format check at import, ~1 s of each such process; no
# notebook is validated against that format)
sys.modules.setdefault("rfc3987_syntax", None)
_stage, _log = os.environ.get("DVC_STAGE"), os.environ.get("OPDKIT_IMPORT_LOG")
if _stage and _log:
    _path = os.path.join(_log, f"{os.getpid()}.txt")
    _busy = []
    def _hook(event, args):
        if event == "import" and not _busy and (args[0] == "opdkit" or str(args[0]).startswith("opdkit.")):
            _busy.append(1)
            try:
                with open(_path, "a") as f:
                    f.write(f"{_stage} {args[0]}\\n")
            finally:
                _busy.pop()
    sys.addaudithook(_hook)
'''


def _module_file(repo: Path, module: str) -> str:
    """``opdkit.studies.padding`` -> ``opdkit/studies/padding.py`` (a package: its ``__init__.py``)."""
    rel = Path(*module.split("."))
    return (rel / "__init__.py" if (repo / rel).is_dir() else rel.with_suffix(".py")).as_posix()


def _merge(base: dict, top: dict) -> dict:
    return {k: _merge(base[k], v) if isinstance(v, dict) else v for k, v in top.items()} | {
        k: v for k, v in base.items() if k not in top}


def _copy_repo(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for name in ("opdkit", "notebooks"):
        shutil.copytree(ROOT / name, dst / name, ignore=ignore)
    shutil.copytree(ROOT / "recipes", dst / "recipes")
    for name in ("dvc.yaml", "params.yaml", ".dvcignore"):
        shutil.copy2(ROOT / name, dst / name)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    (dst / "params.yaml").write_text(yaml.safe_dump(_merge(params, TINY), sort_keys=False))
    (dst / ".gitignore").write_text("/runs/\n")


def _env(tmp: Path) -> dict:
    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp / "imports").mkdir(exist_ok=True)
    e = dict(os.environ)
    e.update(PYTHONPATH=os.pathsep.join([str(tmp / "repo"), str(hook)]),  # the copy's opdkit, not the installed one
             OPDKIT_IMPORT_LOG=str(tmp / "imports"), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
             HF_HUB_OFFLINE="1", DVC_NO_ANALYTICS="1")
    # no byte-code in the copy: with the suite's PYTHONPYCACHEPREFIX (conftest.py) it goes there, and the stages'
    # processes compile the copy's opdkit once, not each of them again
    if not e.get("PYTHONPYCACHEPREFIX"):
        e["PYTHONDONTWRITEBYTECODE"] = "1"
    return e


def _one_cpu(args: list[str]) -> list[str]:
    """``args`` on one CPU (``taskset``, where there is one): the train and eval stages start one worker process
    per CPU they may run on (opdkit/stages/jobs.py default_workers), each importing torch and transformers before
    its first job, seconds of CPU; on one CPU one worker runs their few tiny jobs one after another. The stages
    and jobs are the same; the runs are seeded and deterministic with one thread, whatever the workers.
    (Several workers at once: tests/test_stage_jobs.py.)"""
    taskset = shutil.which("taskset")
    return [taskset, "-c", str(min(os.sched_getaffinity(0))), *args] if taskset else args


def _run(args: list[str], cwd: Path, env: dict, timeout: float = 600) -> str:
    proc = subprocess.run(_one_cpu(args), cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(args)} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def _dvc(repo: Path, env: dict, *args: str) -> str:
    return _run([sys.executable, "-m", "dvc", *args], repo, env)


def _ran(log: str) -> set[str]:
    return {ln.split("'")[1] for ln in log.splitlines() if ln.startswith("Running stage '")}


def _set_param(repo: Path, section: str, key: str, value) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params[section][key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.mark.slow
def test_dvc_repro_on_tiny_params(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _copy_repo(repo)
    env = _env(tmp_path)
    _run(["git", "init", "-q"], repo, env)
    _dvc(repo, env, "init", "-q")
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")  # the track stage's plot template

    # the runs and their evals first: `dvc repro eval` runs that stage and exactly the stages it depends on
    stages = {name for name, _, _ in _stages(repo)}
    upstream = {"embedded", "data", "offline_rollouts", "train", "eval"}
    assert _ran(_dvc(repo, env, "repro", "eval")) == upstream
    runs = repo / "runs"

    # a run trained again from scratch gives the same metrics and evals; only it and its evals run again (checked
    # here, before the stages below the runs exist: a retrained run's checkpoints record other training seconds,
    # so every stage downstream would run again, minutes of notebook kernels and studies for no further check)
    steps = runs / "train" / "rkl" / "seed0" / "metrics" / "train.jsonl"
    losses0 = [(r["loss"], r["kl"], r["grad_norm"]) for r in map(json.loads, steps.read_text().splitlines())]
    before0 = json.loads((runs / "eval" / "rkl" / "seed0.json").read_text())
    shutil.rmtree(runs / "train" / "rkl" / "seed0")
    log = _dvc(repo, env, "repro", "eval")
    assert _ran(log) == {"train", "eval"}
    assert "rkl/seed0: runs" in log and "rkl/seed1: reused" in log and "sft_reference/seed1: reused" in log
    assert "rkl/seed0/checkpoint-3: runs" in log and "rkl/seed1/checkpoint-3: reused" in log
    assert [(r["loss"], r["kl"], r["grad_norm"]) for r in map(json.loads, steps.read_text().splitlines())] == losses0
    assert json.loads((runs / "eval" / "rkl" / "seed0.json").read_text()) == before0

    # then one `dvc repro` runs every other stage (each stage of dvc.yaml has run once it is done)
    assert _ran(_dvc(repo, env, "repro")) == stages - upstream
    # outputs: the pinned subset, published checkpoints, eval JSONs, the report, executed notebooks, figures
    info = json.loads((runs / "data" / "subset.json").read_text())
    assert info["eval"]["rows"] == 300 and len(info["train"]["fingerprint"]) == 64
    for seed in (0, 1):
        ck = runs / "train" / "rkl" / f"seed{seed}" / "checkpoints" / "checkpoint-3"
        meta = json.loads((ck / "opdkit.json").read_text())
        assert meta["step"] == 3 and meta["data_fingerprint"] == info["train"]["fingerprint"]
        ev = json.loads((runs / "eval" / "rkl" / f"seed{seed}.json").read_text())
        assert ev["arm"] == "rkl" and ev["seed"] == str(seed) and ev["n_questions"] == 6 and 0 <= ev["accuracy"] <= 1
    rep = json.loads((runs / "report" / "report.json").read_text())
    assert set(rep["groups"]) == {"before", "teacher", "rkl", "sft_reference"} and rep["groups"]["rkl"]["n"] == 2
    # the control: its own step budget, every kept checkpoint evaluated, compared with the baseline
    assert [p.name for p in sorted((runs / "train" / "sft_reference" / "seed1" / "checkpoints").iterdir())] == [
        "checkpoint-2", "checkpoint-4"]
    cfg1 = yaml.safe_load((runs / "train" / "sft_reference" / "seed1" / "config.yaml").read_text())
    assert cfg1["loss"]["name"] == "sft" and cfg1["loss"]["sft_source"] == "reference" and cfg1["seed"] == 1
    c = rep["comparisons"]["sft_reference"]
    assert c["match"] == "wall" and c["steps"] == 4 and c["paired"]["seeds"] == [0, 1]
    curve = json.loads((runs / "curves" / "sft_reference" / "seed1" / "curve.json").read_text())
    assert [p["step"] for p in curve["points"]] == [2, 4] and curve["arm"] == "sft_reference"
    final = json.loads((runs / "eval" / "sft_reference" / "seed1.json").read_text())
    assert curve["points"][-1]["accuracy"] == final["accuracy"] and final["step"] == "4"
    rows = [json.loads(ln) for ln in (runs / "train" / "sft_reference" / "seed1" / "metrics" / "train.jsonl").open()]
    assert curve["points"][0]["tokens"] == rows[0]["tokens"] + rows[1]["tokens"]
    # the stage's final eval is `opdkit eval` of the last checkpoint, byte for byte
    # (its own entry point, in this process: a `python -m opdkit eval` would spend seconds importing torch again)
    from opdkit.cli import main as opdkit_main

    direct = runs / "direct.json"
    monkeypatch.chdir(repo)  # the stage's working directory: its params.yaml, its relative paths
    assert opdkit_main(["eval", "--model", "runs/train/rkl/seed0/checkpoints/checkpoint-3", "--data",
                        "runs/data/eval.parquet", "--out", str(direct), "--tag", "arm=rkl", "--tag", "seed=0",
                        "--tag", "match=steps", "--tag", "step=3", "--quiet"]) == 0
    monkeypatch.undo()
    assert json.loads(direct.read_text()) == json.loads((runs / "eval" / "rkl" / "seed0.json").read_text())
    direct.unlink(), direct.with_suffix(".jsonl").unlink()
    assert rep["groups"]["teacher"]["mean"] > rep["groups"]["before"]["mean"]
    for nb in ("training_dynamics", "eval_comparison", "repeat_runs", "rollout_inspection", "study_padding",
               "study_clipped_mass"):
        assert (runs / "notebooks" / f"{nb}.ipynb").is_file()
    for png in yaml.safe_load((repo / "dvc.yaml").read_text())["plots"]:
        assert (repo / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    nb_metrics = json.loads((runs / "notebooks" / "repeat_runs" / "metrics.json").read_text())
    assert nb_metrics["groups"]["rkl"]["mean"] == pytest.approx(rep["groups"]["rkl"]["mean"])
    metrics = json.loads(_dvc(repo, env, "metrics", "show", "--json"))[""]["data"]  # the report's and the track's
    shown = metrics["runs/report/report.json"]["data"]
    assert shown["groups"]["rkl"]["mean"] == rep["groups"]["rkl"]["mean"] and "teacher" in shown["groups"]
    # each run's training seconds (its final checkpoint's), beside its steps
    final4 = json.loads((runs / "train" / "sft_reference" / "seed1" / "checkpoints" / "checkpoint-4" / "opdkit.json")
                        .read_text())
    got = [r["train_s"] for r in rep["runs"] if r["arm"] == "sft_reference" and r["seed"] == 1]
    assert got == [final4["elapsed_s"]]
    assert rep["groups"]["rkl"]["train_s_ratio"] == 1.0 and "train_s" not in rep["runs"][0]  # before: no checkpoint

    # dvc plots show: each run's training curves (its DVCLive log, gathered by the track stage), every point of
    # train.jsonl, and its learning curve; dvc metrics show: each run's last step and final eval accuracy
    matrix = {"rkl": 3, "sft_reference": 4}  # arm: steps, over seeds 0 and 1
    jsonl = {f"{arm}/seed{s}": [json.loads(ln) for ln in (runs / "train" / arm / f"seed{s}" / "metrics" / "train.jsonl")
                                .read_text().splitlines()] for arm in matrix for s in (0, 1)}
    assert {r: [row["step"] for row in rows] for r, rows in jsonl.items()} == {
        f"{arm}/seed{s}": list(range(1, n + 1)) for arm, n in matrix.items() for s in (0, 1)}
    plots = json.loads(_dvc(repo, env, "plots", "show", "--json"))
    drawn = {Path(f).stem: p[0]["content"]["data"]["values"] for f, p in plots["data"].items() if "runs/track/" in f}
    assert set(drawn) == {"loss", "kl", "lr", "clipped_mass", "eval_accuracy"}, plots.get("errors")
    for name in ("loss", "kl", "lr", "clipped_mass"):
        got = sorted((d["run"], int(d["step"]), float(d[name])) for d in drawn[name])
        assert got == sorted((r, row["step"], row[name]) for r, rows in jsonl.items() for row in rows
                             if row.get(name) is not None), name
    assert {d["run"] for d in drawn["clipped_mass"]} == {"rkl/seed0", "rkl/seed1"}  # the sft control has none
    for r in jsonl:
        points = json.loads((runs / "curves" / r / "curve.json").read_text())["points"]
        assert sorted((int(d["step"]), float(d["accuracy"])) for d in drawn["eval_accuracy"] if d["run"] == r) == [
            (p["step"], p["accuracy"]) for p in points]
    tracked = metrics["runs/track/metrics.json"]["data"]
    for r, rows in jsonl.items():
        arm, seed = r.split("/")
        final = json.loads((runs / "eval" / arm / f"{seed}.json").read_text())["accuracy"]
        last = {k: rows[-1][k] for k in ("loss", "kl", "lr", "clipped_mass") if rows[-1].get(k) is not None}
        assert tracked[arm][seed] == {"step": rows[-1]["step"], **last, "eval_accuracy": final}

    # each stage imported only opdkit modules it declares (the hook logged every process of every stage)
    declared = {name: [d.def_path for d in deps if type(d).__name__ != "ParamsDependency"]
                for name, _, deps in _stages(repo)}
    seen: dict[str, set[str]] = {}
    for f in (tmp_path / "imports").glob("*.txt"):
        for line in f.read_text().splitlines():
            stage, module = line.split()
            if (repo / _module_file(repo, module)).is_file():  # (not a failed optional import)
                seen.setdefault(stage, set()).add(_module_file(repo, module))
    assert set(seen) >= {"train", "eval", "study_padding", "nb_rollout_inspection"}
    missing = {name: [f for f in sorted(files - NOT_A_CODE_DEP)
                      if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in declared[name])]
               for name, files in seen.items()}
    missing = {name: files for name, files in missing.items() if files}
    assert not missing, f"stages import modules they do not list as deps (stage: modules): {missing}"

    # nothing changed: a second repro runs nothing, and status is clean
    assert _ran(_dvc(repo, env, "repro")) == set()
    assert "up to date" in _dvc(repo, env, "status")

    # a loss param invalidates only the training stage (everything downstream follows from it)
    _set_param(repo, "loss", "clip", "entry")
    changed = json.loads(_dvc(repo, env, "status", "--json"))
    assert set(changed) == {"train"}, changed
    _set_param(repo, "loss", "clip", "none")
    assert json.loads(_dvc(repo, env, "status", "--json")) == {}

    # dvc.lock pins the recipe in use (its name and hash); editing it invalidates the stages that apply it
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    recipe = "recipes/embedded.yaml"
    for name in ("data", "train", "eval", "study_padding", "nb_rollout_inspection"):
        assert lock[name]["params"]["params.yaml"]["recipe"] == recipe, name
        assert [d["md5"] for d in lock[name]["deps"] if d["path"] == recipe], name
    text = (repo / recipe).read_text()
    (repo / recipe).write_text(text + "optim:\n  lr: 2.0e-4\n")
    changed = set(json.loads(_dvc(repo, env, "status", "--json")))
    assert changed == {"data", "offline_rollouts", "train", "eval", "study_padding", "study_clipped_mass",
                       "nb_rollout_inspection"}
    (repo / recipe).write_text(text)
    assert json.loads(_dvc(repo, env, "status", "--json")) == {}

    # strays in the stages' folders (a dropped seed's run and eval) are removed, the runs reused: no report changes
    report0 = json.loads((runs / "report" / "report.json").read_text())
    shutil.copytree(runs / "train" / "rkl" / "seed1", runs / "train" / "rkl" / "seed9")
    shutil.copy(runs / "eval" / "rkl" / "seed1.json", runs / "eval" / "rkl" / "seed9.json")
    log = _dvc(repo, env, "repro")
    assert _ran(log) == {"train",
                         "eval"} and "rkl/seed1: reused" in log and "sft_reference/seed0/checkpoint-2: reused" in log
    assert not (runs / "train" / "rkl" / "seed9").exists() and not (runs / "eval" / "rkl" / "seed9.json").exists()
    assert json.loads((runs / "report" / "report.json").read_text()) == report0
    assert "up to date" in _dvc(repo, env, "status")

    # dvc exp show (once there is a commit): the runs' final train metrics beside the params
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tiny"], repo, env)
    (row,) = [r for r in json.loads(_dvc(repo, env, "exp", "show", "--json")) if r["rev"] == "workspace"]
    assert row["data"]["metrics"]["runs/track/metrics.json"]["data"]["rkl"]["seed0"]["step"] == 3
    assert row["data"]["params"]["params.yaml"]["data"]["tracking"] == "dvclive"


def test_calibration_takes_the_median_step_and_matches_the_baseline_wall_clock():
    from opdkit.config import load_config
    from opdkit.stages.calibrate import seconds_per_step, stage_seconds, wall_matched

    rows = [{"step": i + 1, "elapsed_s": t} for i, t in enumerate([9.0, 10.0, 11.5, 12.0, 14.0])]
    assert seconds_per_step(rows, skip=1) == 1.5  # steps of 1.0 | 1.5, 0.5, 2.0 -> median 1.5
    with pytest.raises(ValueError, match="raise --steps"):
        seconds_per_step(rows, skip=4)
    cfg = load_config(None, ["budget.max_steps=120"])
    assert wall_matched(cfg, s_baseline=1.0, s_arm=0.5, every_points=4) == (240, 60)  # twice as fast: 240 steps
    assert wall_matched(cfg, s_baseline=1.0, s_arm=0.09, every_points=4) == (1333, 334)  # 120 / 0.09 = 1333.3
    # the train stage's runs, longest first on free processes: 6 runs of 100 s and 3 of 10 s
    runs = [100.0] * 6 + [10.0] * 3
    assert stage_seconds(runs, 8) == 100.0 and stage_seconds(runs, 2) == 320.0 and stage_seconds(runs, 1) == 630.0

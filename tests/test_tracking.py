"""The per-step trackers (opdkit.tracking): DVCLive's files hold every step's numbers (read back as plain
TSV/JSON/YAML), a resumed run's history is train.jsonl's and not a killed attempt's, TensorBoard's event
files read back through TensorBoard's own EventAccumulator, `none` writes nothing, a tracker that fails
warns and records it without raising, and a tracker whose package is missing stops `opdkit train` before
it writes anything."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from opdkit import tracking
from opdkit.tracking import Tracker

PARAMS = {"seed": 0, "loss": {"name": "rkl", "clip_tau": 0.05}, "lora": {"target_modules": ["q_proj", "v_proj"]}}


def rows(steps, shift: float = 0.0) -> list[dict]:
    """train.jsonl-shaped rows: floats, an int, a null (a metric this step lacks), a dict and a list."""
    return [{"step": s, "loss": 1.0 / s + shift, "lr": 1e-4 * s, "tokens": 10 * s,
             "kl": None if s == 2 else 0.5 + shift, "alignment": {"rows": 4}, "skipped_nonfinite": ["loss"]}
            for s in steps]


def write_jsonl(path: Path, rs: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rs))
    return path


def tsv(out: Path, name: str) -> list[tuple[int, float]]:
    with (out / "dvclive" / "plots" / "metrics" / f"{name}.tsv").open(newline="") as f:
        table = list(csv.reader(f, delimiter="\t"))
    assert table[0] == ["step", name]
    return [(int(s), float(v)) for s, v in table[1:]]


def log_all(t: Tracker, rs: list[dict]) -> None:
    for r in rs:
        t.log(r)


def test_dvclive_logs_every_step_into_the_runs_folder_and_nothing_else(tmp_path, monkeypatch):
    repo = tmp_path / "repo"  # a git repository without DVC, with no commits: DVCLive's own set-up fails here
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    monkeypatch.chdir(repo)
    out, said = repo / "out", []
    with Tracker("dvclive", out, None, PARAMS, said.append) as t:
        log_all(t, rows(range(1, 6)))
    assert t.record == {"kind": "dvclive", "error": None} and f"tracking: dvclive into {out / 'dvclive'}" in said
    assert tsv(out, "loss") == [(s, 1.0 / s) for s in range(1, 6)]
    assert tsv(out, "tokens") == [(s, 10 * s) for s in range(1, 6)]
    assert tsv(out, "kl") == [(s, 0.5) for s in (1, 3, 4, 5)]  # a null is no point
    summary = json.loads((out / "dvclive" / "metrics.json").read_text())
    assert summary == {"step": 5, "loss": 0.2, "lr": 1e-4 * 5, "tokens": 50, "kl": 0.5}
    assert yaml.safe_load((out / "dvclive" / "params.yaml").read_text()) == PARAMS
    assert sorted(p.name for p in (out / "dvclive" / "plots" / "metrics").iterdir()) == [
        "kl.tsv", "loss.tsv", "lr.tsv", "tokens.tsv"]
    # no dvc.yaml, no `dvc init` of the enclosing repository, nothing outside the run's folder
    assert sorted(p.name for p in repo.iterdir()) == [".git", "out"] and not list(out.rglob("dvc.yaml"))


def test_dvclive_on_resume_keeps_train_jsonls_steps_not_a_killed_attempts(tmp_path):
    out = tmp_path / "out"
    with Tracker("dvclive", out, None, PARAMS) as t:  # the first attempt logged steps 1-5, then was killed ...
        log_all(t, rows(range(1, 6)))
    history = write_jsonl(out / "metrics" / "train.jsonl", rows(range(1, 4)))  # ... and its state is at step 3
    with Tracker("dvclive", out, history, PARAMS) as t:  # the resumed start: steps 4-6 again, other numbers
        assert tsv(out, "loss") == [(s, 1.0 / s) for s in (1, 2, 3)]
        log_all(t, rows(range(4, 7), shift=1.0))
    assert tsv(out, "loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3)] + [(s, 1.0 / s + 1.0) for s in (4, 5, 6)]
    assert tsv(out, "kl") == [(1, 0.5), (3, 0.5), (4, 1.5), (5, 1.5), (6, 1.5)]
    assert json.loads((out / "dvclive" / "metrics.json").read_text())["step"] == 6
    # a start that ends at once (its step budget already spent) leaves the summary at the saved step
    with Tracker("dvclive", out, history, PARAMS):
        pass
    assert json.loads((out / "dvclive" / "metrics.json").read_text()) == {
        "step": 3, "loss": 1 / 3, "lr": 1e-4 * 3, "tokens": 30, "kl": 0.5}
    assert tsv(out, "lr") == [(s, 1e-4 * s) for s in (1, 2, 3)]
    # a first attempt that tracked nothing (tracking: none) leaves no gap once it is resumed with dvclive
    fresh = tmp_path / "fresh"
    with Tracker("dvclive", fresh, write_jsonl(fresh / "metrics" / "train.jsonl", rows(range(1, 4))), PARAMS) as t:
        t.log(rows([4])[0])
    assert [s for s, _ in tsv(fresh, "loss")] == [1, 2, 3, 4]


def _scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard is not installed (pip install -e '.[track]')")
def test_tensorboard_events_read_back_with_tensorboard_and_resume_purges_a_killed_attempt(tmp_path):
    out = tmp_path / "out"
    with Tracker("tensorboard", out, None, PARAMS) as t:
        log_all(t, rows(range(1, 6)))
    assert _scalars(out / "tensorboard", "loss") == [(s, pytest.approx(1.0 / s)) for s in range(1, 6)]
    assert [s for s, _ in _scalars(out / "tensorboard", "kl")] == [1, 3, 4, 5]
    history = write_jsonl(out / "metrics" / "train.jsonl", rows(range(1, 4)))
    with Tracker("tensorboard", out, history, PARAMS) as t:
        log_all(t, rows(range(4, 7), shift=1.0))
    assert _scalars(out / "tensorboard", "loss") == [(s, pytest.approx(1.0 / s + (s > 3))) for s in range(1, 7)]
    assert sorted(p.name for p in out.iterdir()) == ["metrics", "tensorboard"]


def test_none_writes_nothing(tmp_path):
    out = tmp_path / "out"
    with Tracker("none", out, write_jsonl(tmp_path / "train.jsonl", rows([1])), PARAMS) as t:
        log_all(t, rows(range(2, 5)))
    assert not out.exists() and t.record == {"kind": "none", "error": None}


def test_a_tracker_that_fails_warns_records_it_and_lets_the_run_go_on(tmp_path):
    out, said = tmp_path / "out", []
    t = Tracker("dvclive", out, None, PARAMS, said.append)
    log_all(t, rows([1, 2]))
    loss = out / "dvclive" / "plots" / "metrics" / "loss.tsv"
    loss.unlink()
    loss.mkdir()  # the next append to it fails, as a lost mount or a full disk would
    log_all(t, rows([3, 4]))  # does not raise
    t.close()
    assert t.record["error"].startswith("step 3: IsADirectoryError")
    assert [ln for ln in said if ln.startswith("warning: tracking (dvclive) failed at step 3")]
    assert tsv(out, "lr") == [(1, 1e-4), (2, 2e-4)]  # nothing after the failure
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "dvclive").write_text("a file where the folder goes")
    with Tracker("dvclive", blocked, None, PARAMS, said.append) as t:  # fails at the start: the run still goes on
        t.log(rows([1])[0])
    assert t.record["error"].startswith("step 0: ")


def test_a_tracker_whose_package_is_missing_is_refused_before_the_run_writes(tmp_path, monkeypatch):
    from opdkit.config import load_config
    from opdkit.setup import RunError
    from opdkit.train import train

    assert tracking.resolve("auto") == ("dvclive" if importlib.util.find_spec("dvclive") else "none")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("dvclive", "tensorboard")
                        else real(name, *a))
    assert tracking.resolve("auto") == "none" and tracking.resolve("none") == "none"
    with pytest.raises(tracking.TrackingError, match=r"'tracking': tensorboard needs the tensorboard package"):
        tracking.resolve("tensorboard")
    out = tmp_path / "out"
    with pytest.raises(RunError, match=r"params key 'tracking': dvclive needs the dvclive package .*tracking: none"):
        train(load_config(None, ["tracking=dvclive", "budget.max_steps=1"]), out, log=lambda s: None, progress=False)
    assert not out.exists()


def test_the_pipelines_train_stage_refuses_another_tracker_before_any_run(tmp_path):
    """The track stage reads DVCLive logs: a pipeline with tracking: tensorboard stops at once, not after training."""
    from opdkit.config import ConfigError
    from opdkit.stages.train_runs import main, train_jobs

    root = Path(__file__).resolve().parents[1]
    assert train_jobs(str(root / "params.yaml"), "S", "T", "D", str(tmp_path / "train"), "logs")  # params.yaml: dvclive
    with pytest.raises(ConfigError, match="the track stage .* reads each run's DVCLive log"):
        train_jobs(str(root / "params.yaml"), "S", "T", "D", str(tmp_path / "train"), "logs", ["tracking=tensorboard"])
    assert main(["--student", "S", "--teacher", "T", "--data", "D", "--out", str(tmp_path / "train"),
                 "-p", str(root / "params.yaml"), "-S", "tracking=none"]) == 2
    assert not (tmp_path / "train").exists()

"""The pipeline's side-by-side jobs (opdkit.stages.jobs, train_runs): a run's files are the same alone
and beside others, a job is reused only when nothing that made it changed, strays are pruned, a failed
job does not stop the others, and the controls' reuse ignores only keys they do not read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opdkit.stages import jobs as J
from opdkit.stages.train_runs import CONTROL_IGNORES, train_jobs

ROOT = Path(__file__).resolve().parents[1]
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=16",
        "budget.max_steps=3", "budget.max_wall_time_s=0", "optim.schedule=cosine", "publish.every_steps=2",
        "runtime.threads=1"]
TIME_KEYS = ("elapsed_s", "tokens_per_s", "time_rollout_s", "time_score_s", "time_update_s", "peak_mem_gb")


def _embedded_job(tmp: Path, name: str, **kw) -> J.Job:
    """A cheap real job: `opdkit embedded --out OUT` (copies the shipped assets)."""
    (tmp / f"in_{name}.txt").write_text(kw.pop("input_text", "x"))
    out = tmp / "out" / name
    return J.Job(name, ("embedded", "--out", str(out)), (str(tmp / f"in_{name}.txt"),), (str(out),),
                 kw.pop("config", {"k": 1}), log=str(tmp / "logs" / f"{name}.log"), **kw)


def _run(jobs, tmp: Path, workers: int = 1) -> tuple[int, list[str]]:  # one process: its start-up is the cost
    lines: list[str] = []
    status = J.run_jobs(jobs, tmp / "out" / "jobs.json", workers, 1, roots=[tmp / "out"], log=lines.append)
    return status, lines


def test_jobs_are_reused_only_when_nothing_that_made_them_changed(tmp_path):
    a, b = _embedded_job(tmp_path, "a"), _embedded_job(tmp_path, "b")
    status, log = _run([a, b], tmp_path)
    assert status == 0 and (tmp_path / "out" / "a" / "student" / "config.json").is_file()
    ledger = json.loads((tmp_path / "out" / "jobs.json").read_text())["jobs"]
    assert ledger["a"]["outputs"] == {a.outputs[0]: J.fingerprint(a.outputs[0])}
    assert {"opdkit/cli.py", "opdkit/embedded/__init__.py"} <= set(ledger["a"]["code"])  # what the worker imported
    assert ledger["a"]["code"]["opdkit/cli.py"] == J.file_sha256(ROOT / "opdkit" / "cli.py")

    status, log = _run([a, b], tmp_path)
    assert status == 0 and all(": reused" in ln for ln in log if ln.startswith(("a:", "b:"))), log
    # an input, an output, the params, the code: each makes its job run again (and only it)
    (tmp_path / "in_b.txt").write_text("y")
    (tmp_path / "out" / "a" / "student" / "config.json").write_text("{}")
    _, log = _run([a, b], tmp_path)
    assert "a: runs (output " in log[0] and "b: runs (input " in log[1], log
    assert json.loads((tmp_path / "out" / "a" / "student" / "config.json").read_text())  # made again
    _, log = _run([a, J.Job(**{**b.__dict__, "config": {"k": 2}})], tmp_path)
    assert log[0].startswith("a: reused") and log[1] == "b: runs (params changed (k: 1 -> 2))", log
    ledger_file = tmp_path / "out" / "jobs.json"
    raw = json.loads(ledger_file.read_text())
    raw["jobs"]["a"]["code"]["opdkit/cli.py"] = "0" * 64  # as if cli.py had another content when a ran
    ledger_file.write_text(json.dumps(raw))
    _, log = _run([a, J.Job(**{**b.__dict__, "config": {"k": 2}})], tmp_path)
    assert log[0] == "a: runs (code changed (opdkit/cli.py))" and log[1].startswith("b: reused"), log


def test_strays_are_pruned_and_a_failed_job_does_not_stop_the_others(tmp_path):
    a, b = _embedded_job(tmp_path, "a"), _embedded_job(tmp_path, "b")
    (tmp_path / "out" / "dropped" / "seed9").mkdir(parents=True)
    (tmp_path / "out" / "stray.txt").write_text("left by an older matrix")
    (tmp_path / "blocker").write_text("a file, so a directory cannot be made under it")
    bad = J.Job("bad", ("embedded", "--out", str(tmp_path / "blocker" / "x")), (), (str(tmp_path / "out" / "bad"),),
                {}, log=str(tmp_path / "logs" / "bad.log"))
    status, log = _run([a, bad, b], tmp_path)
    assert status == 1 and any(ln.startswith("bad: FAILED with exit status") for ln in log), log
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a", "b", "jobs.json"]
    assert any("removed" in ln and "dropped" in ln for ln in log) and any("stray.txt" in ln for ln in log)
    assert sorted(json.loads((tmp_path / "out" / "jobs.json").read_text())["jobs"]) == ["a", "b"]  # bad: not recorded
    _, log = _run([a, bad, b], tmp_path)
    assert log[:3] == ["a: reused (command, params, inputs, code and outputs unchanged)", "bad: runs (not run before)",
                       "b: reused (command, params, inputs, code and outputs unchanged)"]


def _train_argv(out: Path, seed: int) -> tuple[str, ...]:
    return ("train", "--out", str(out), "--quiet", "-p", "none", *sum((["-S", s] for s in [*TINY, f"seed={seed}"]), []))


def _run_files(run: Path) -> dict:
    """What must not depend on what ran beside it: weights, metrics (timings left out), how the run ended."""
    ckpts = {p.name: (p / "model.safetensors").read_bytes() for p in sorted((run / "checkpoints").iterdir())}
    rows = [{k: v for k, v in json.loads(ln).items() if k not in TIME_KEYS}
            for ln in (run / "metrics" / "train.jsonl").read_text().splitlines()]
    # (the end's clock readings: elapsed, the final saves' end, each save's seconds, the stop's reserve)
    end = {k: v for k, v in json.loads((run / "run.json").read_text()).items()
           if k not in ("elapsed_s", "ended_s", "saves", "stop", "run_id")}
    return {"checkpoints": ckpts, "metrics": rows, "run": end}


@pytest.mark.slow
def test_a_run_is_bit_identical_alone_and_beside_others(tmp_path):
    """`opdkit train` alone in a fresh process, and the same run as the second job of a worker of a
    2-process pool while another run trains beside it: the same weights, metrics and end."""
    subprocess.run([sys.executable, "-m", "opdkit", *_train_argv(tmp_path / "alone", 0)], check=True,
                   capture_output=True, cwd=tmp_path)
    pool = tmp_path / "out"
    jobs = [J.Job(f"seed{s}", _train_argv(pool / f"seed{s}", s), (), (str(pool / f"seed{s}"),), {}, cost,
                  str(tmp_path / "logs" / f"seed{s}.log")) for s, cost in ((1, 3.0), (2, 2.0), (0, 1.0))]
    status, log = _run(jobs, tmp_path, workers=2)
    assert status == 0, log
    alone, pooled = _run_files(tmp_path / "alone"), _run_files(pool / "seed0")
    assert list(alone["checkpoints"]) == ["checkpoint-2", "checkpoint-3"]
    assert alone == pooled
    assert _run_files(pool / "seed1")["checkpoints"] != pooled["checkpoints"]  # another seed: other weights


def test_a_control_s_reuse_ignores_exactly_the_knobs_it_does_not_read():
    """Changing a key of CONTROL_IGNORES changes the OPD runs' reuse config, never a control's."""
    params = ROOT / "params.yaml"
    base = {j.name: j.config for j in train_jobs(str(params), "S", "T", "D", "runs/train", "logs")}
    values = {"teacher.ema_decay": 0.5, "loss.clip_eps": 0.3, "loss.dual_clip": 0.0, "loss.topk": 4,
              "loss.tail_bucket": False, "loss.jsd_beta": 0.9, "loss.clip": "entry", "loss.clip_tau": 0.5,
              "loss.reward_baseline": "loo", "loss.reward_norm": "std", "rollout.offline_file": "POOL",
              "rollout.offline_ratio": "none"}
    assert set(values) == set(CONTROL_IGNORES)
    for key, value in values.items():
        changed = {j.name: j.config for j in train_jobs(str(params), "S", "T", "D", "runs/train", "logs",
                                                         [f"{key}={yaml.safe_dump(value).strip()}"])}
        assert changed["rkl/seed0"] != base["rkl/seed0"], key
        assert changed["sft_teacher/seed0"] == base["sft_teacher/seed0"], key
        assert changed["sft_reference/seed0"] == base["sft_reference/seed0"], key


@pytest.mark.slow
def test_an_sft_control_trains_the_same_whatever_the_keys_its_reuse_ignores(tmp_path):
    from opdkit.config import load_config
    from opdkit.train import train

    ctl = [*TINY, "budget.max_steps=2", "loss.name=sft", "loss.sft_source=teacher", "teacher.source=model"]
    other = ["teacher.ema_decay=0.5", "loss.clip_eps=0.3", "loss.dual_clip=0", "loss.topk=4", "loss.tail_bucket=false",
             "loss.jsd_beta=0.9", "loss.clip=entry", "loss.clip_tau=0.5", "loss.reward_baseline=loo",
             "loss.reward_norm=std", "rollout.offline_file=POOL", "rollout.offline_ratio=none"]
    assert {o.split("=")[0] for o in other} == set(CONTROL_IGNORES)
    for name, sets in (("base", ctl), ("other", ctl + other)):
        train(load_config(None, sets), tmp_path / name, log=lambda *a: None, progress=False)
    assert _run_files(tmp_path / "base") == _run_files(tmp_path / "other")

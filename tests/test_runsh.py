"""run.sh, the formal replay, run as a real process: the env contract, the exit statuses, the lock,
signal forwarding, the torchrun launch, and that a trainer exit 0 is only believed when the final
checkpoint validates. (Kills and resumes: test_resume.py; bad inputs: test_cli_errors.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from opdkit import trainer_state
from opdkit.checkpoints import is_valid_checkpoint, list_checkpoints
from opdkit.embedded import asset
from procs import env

REPO = Path(__file__).resolve().parents[1]
RUN_SH = REPO / "run.sh"
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "runtime.threads=1", "optim.schedule=constant"]
METRIC_KEYS = {"step", "elapsed_s", "lr", "loss", "kl", "grad_norm", "response_len", "truncated_frac", "tokens",
               "tokens_per_s"}


def run_sh(cwd: Path, *args: str, timeout: float = 300, **env_vars) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUN_SH), *args], cwd=cwd, env=env(**env_vars), text=True,
                          capture_output=True, timeout=timeout)


def metric_steps(out: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_run_sh_trains_to_the_wall_clock_and_a_rerun_of_the_finished_run_exits_0_at_once(tmp_path):
    out = tmp_path / "out"
    data = asset("train")
    env_vars = dict(OUTPUT_DIR=str(out), STUDENT_MODEL=str(asset("student")), TEACHER_MODEL=str(asset("teacher")),
                    TRAIN_DATA=str(data), MAX_WALL_TIME_SECONDS="14", DEADLINE_RESERVE_SECONDS="4",
                    EXPERIMENT_NAME="smoke's 1")
    args = [*TINY, "publish.every_steps=5"]
    proc = run_sh(tmp_path, *args, **env_vars)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # it prints what it runs: the env mapped to overrides, then the trailing ones
    running = next(ln for ln in proc.stdout.splitlines() if ln.startswith("run.sh: running: "))
    assert f"-m opdkit train --out {out} " in running and "experiment smoke's 1" in proc.stdout
    for kv in (f"student.path={asset('student')}", f"teacher.path={asset('teacher')}", f"data.train={data}",
               "budget.max_wall_time_s=14", "budget.deadline_reserve_s=4", "publish.every_steps=5"):
        assert f"-S {kv}" in running

    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["reason"], run["experiment_name"]) == ("completed", "wall_clock", "smoke's 1")
    final = out / "checkpoints" / f"checkpoint-{run['step']}"
    assert proc.stdout.rstrip().endswith(f"final checkpoint {final}")
    assert list_checkpoints(out / "checkpoints")[-1] == final
    for c in list_checkpoints(out / "checkpoints"):
        assert is_valid_checkpoint(c) == (True, "ok")
    meta = json.loads((final / "opdkit.json").read_text())
    assert meta["step"] == run["step"] and meta["params"]["budget"]["max_wall_time_s"] == 14.0
    assert meta["params"]["experiment_name"] == "smoke's 1"
    assert {"elapsed_s", "data_fingerprint", "code_revision", "source_student"} <= set(meta)
    rows = [json.loads(ln) for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, run["step"] + 1)) and all(METRIC_KEYS <= set(r) for r in rows)
    # a step starts only if it is expected to end (as long as the last one) before the reserve
    for r in rows[:-1]:
        assert r["elapsed_s"] + r["time_rollout_s"] + r["time_score_s"] + r["time_update_s"] + 4 < 14
    assert trainer_state.peek(out)["step"] == run["step"]

    again = run_sh(tmp_path, *args, **{**env_vars, "EXPERIMENT_NAME": "renamed"})  # a label: resumes all the same
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout and "nothing to do" in again.stdout
    assert "alignment check" not in again.stdout  # no step ran
    assert metric_steps(out) == list(range(1, run["step"] + 1))


def _hold_lock(out: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom opdkit.fsutil import OutputLock\n"
         "lock = OutputLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(120)", str(out)],
        stdout=subprocess.PIPE, text=True, env=env())
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_run_sh_exits_75_at_once_when_another_run_holds_output_dir(tmp_path, nproc):
    out = tmp_path / "out"
    holder = _hold_lock(out)
    try:
        before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
        t0 = time.monotonic()
        proc = run_sh(tmp_path, "budget.max_steps=2", OUTPUT_DIR=str(out), NPROC=nproc, timeout=60)
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 75, proc.stderr
    assert proc.stderr.splitlines() == [f"opdkit: output directory {out} is in use by another run "
                                        f"(pid={holder.pid} host={os.uname().nodename}); wait for it to finish "
                                        "or choose another output directory"]
    assert took < 20  # before any model or data is loaded (a second or two; loaded machines are slow)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before


def _fake_command(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_run_sh_launches_torchrun_with_nproc_after_a_preflight_and_propagates_its_status(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_command(bin_dir / "torchrun", f'printf "%s\\n" "$@" > {tmp_path}/torchrun.args\nexit 4\n')
    out = tmp_path / "out"
    path = f"{bin_dir}:{os.environ['PATH']}"
    proc = run_sh(tmp_path, "budget.max_steps=2", OUTPUT_DIR=str(out), NPROC="2", PATH=path)
    assert proc.returncode == 4
    argv = (tmp_path / "torchrun.args").read_text().splitlines()
    assert argv == ["--standalone", "--nproc-per-node", "2", "-m", "opdkit", "train", "--out", str(out), "-p", "none", "-S", "budget.max_steps=2"]
    assert "run.sh: training failed (exit 4)" in proc.stderr and "no checkpoint survives" in proc.stderr
    assert not out.exists()  # the preflight (`opdkit train --check`) writes nothing

    (tmp_path / "torchrun.args").unlink()
    proc = run_sh(tmp_path, "budget.max_steps=two", OUTPUT_DIR=str(out), NPROC="2", PATH=path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert not (tmp_path / "torchrun.args").exists()  # bad input never reaches torchrun


FAKE_TRAINERS = {
    # a trainer that says "done" but its final checkpoint is a stub
    "final checkpoint invalid": (
        'mkdir -p "$5/checkpoints/checkpoint-2"; cp {config} "$5/checkpoints/checkpoint-2/"\n'
        'echo \'{{"status": "completed", "step": 2}}\' > "$5/run.json"', "does not validate"),
    # ... or that leaves no record of having finished
    "no completed run recorded": ('mkdir -p "$5"', "does not record a completed run"),
    # ... or whose final step is not the newest checkpoint (a stale one from elsewhere)
    "final is not the newest": (
        'mkdir -p "$5/checkpoints/checkpoint-9"\n'
        'echo \'{{"status": "completed", "step": 2}}\' > "$5/run.json"', "should be"),
}


@pytest.mark.parametrize("case", list(FAKE_TRAINERS))
def test_run_sh_never_reports_success_without_a_valid_final_checkpoint(tmp_path, case):
    body, expected = FAKE_TRAINERS[case]
    config = asset("student") / "config.json"
    fake_python = _fake_command(tmp_path / "python", (
        f'if [[ "$1 $2 $3" == "-m opdkit train" ]]; then\n{body.format(config=config)}\nexit 0\nfi\n'
        f'exec {sys.executable} "$@"\n'))
    out = tmp_path / "out"
    proc = run_sh(tmp_path, OUTPUT_DIR=str(out), PYTHON=str(fake_python))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "run.sh: done" not in proc.stdout


@pytest.mark.slow
def test_sigterm_to_run_sh_stops_the_trainer_cleanly_and_lists_survivors(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(RUN_SH), *TINY, "budget.max_steps=200", "publish.every_steps=1"],
                            cwd=tmp_path, env=env(OUTPUT_DIR=str(out)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = out / "metrics" / "train.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the trainer did not reach step 2"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert re.search(r"opdkit: training stopped by SIGTERM at step \d+; surviving valid checkpoints: checkpoint-", stderr)
    assert "run.sh: training was killed by signal 15 (exit 143)" in stderr
    assert f"run.sh: surviving valid checkpoints in {out}/checkpoints: checkpoint-" in stderr
    ckpts = list_checkpoints(out / "checkpoints")
    assert ckpts and all(is_valid_checkpoint(c) == (True, "ok") for c in ckpts)
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["reason"]) == ("stopped", "SIGTERM")
    assert not any(p.name.startswith(".tmp") for p in (out / "checkpoints").iterdir())
    # the step in flight finished: it has a metrics row, the trainer state and the newest checkpoint
    state = trainer_state.peek(out)
    assert metric_steps(out)[-1] == run["step"] == state["step"] == int(ckpts[-1].name.split("-")[1])

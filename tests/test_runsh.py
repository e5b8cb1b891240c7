"""run.sh, the formal replay, run as a real process: the env contract (S1's formal replay by default, RECIPE,
CKPT_DIR, the OPSD switches), the exit statuses, the locks (output, checkpoint directory, GPU workload), signal
forwarding, the torchrun launch, and that a trainer exit 0 is only believed when the final checkpoint validates.
(Kills and resumes: test_resume.py; bad inputs: test_cli_errors.py.)
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

from opdkit.embedded import asset
from opdkit.persist import trainer_state
from opdkit.persist.checkpoints import is_valid_checkpoint
from opdkit.persist.fsutil import list_checkpoints
from procs import env
from qwen2_fixture import fixture_dir
from test_recipes import OPSD_RELEASED, S1_BASELINE, S1_FORMAL, mismatches

REPO = Path(__file__).resolve().parents[1]
RUN_SH = REPO / "run.sh"
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "runtime.threads=1", "optim.schedule=constant"]
METRIC_KEYS = {"step", "elapsed_s", "lr", "loss", "kl", "grad_norm", "response_len", "truncated_frac", "tokens",
               "tokens_per_s"}


def run_sh(cwd: Path, *args: str, timeout: float = 300, runner=None, real_trainer: bool = False,
           **env_vars) -> subprocess.CompletedProcess:
    """``bash run.sh ARGS``; with the warm ``runner`` (conftest), its ``python -m opdkit`` commands run in children
    of the runner (``signal_harness.OpdkitRunner.python``), each spared a fresh interpreter's imports of torch
    (``real_trainer``: all but the trainer itself, which the real interpreter starts as always)."""
    e = runner.env(real_trainer=real_trainer, **env_vars) if runner else env(**env_vars)
    return subprocess.run(["bash", str(RUN_SH), *args], cwd=cwd, env=e, text=True, capture_output=True,
                          timeout=timeout)


def metric_steps(out: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_run_sh_trains_to_the_wall_clock_and_a_rerun_of_the_finished_run_exits_0_at_once(tmp_path, runner):
    out = tmp_path / "out"
    data = asset("train")
    env_vars = dict(OUTPUT_DIR=str(out), STUDENT_MODEL=str(asset("student")), TEACHER_MODEL=str(asset("teacher")),
                    TRAIN_DATA=str(data), MAX_WALL_TIME_SECONDS="14", DEADLINE_RESERVE_SECONDS="4",
                    EXPERIMENT_NAME="smoke's 1", RECIPE="none")  # the embedded models: the built-in defaults, not S1's
    args = [*TINY, "publish.every_steps=5"]
    proc = run_sh(tmp_path, *args, runner=runner, **env_vars)
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

    # a label: resumes all the same
    again = run_sh(tmp_path, *args, runner=runner, **{**env_vars, "EXPERIMENT_NAME": "renamed"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout and "nothing to do" in again.stdout
    assert "alignment check" not in again.stdout  # no step ran
    assert metric_steps(out) == list(range(1, run["step"] + 1))


def _hold_lock(out: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom opdkit.persist.fsutil import OutputLock\n"
         "lock = OutputLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(120)", str(out)],
        stdout=subprocess.PIPE, text=True, env=env())
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_run_sh_exits_75_at_once_when_another_run_holds_output_dir(tmp_path, nproc, runner):
    out = tmp_path / "out"
    holder = _hold_lock(out)
    try:
        before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
        t0 = time.monotonic()
        proc = run_sh(tmp_path, "budget.max_steps=2", OUTPUT_DIR=str(out), NPROC=nproc, timeout=60, runner=runner)
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


def test_run_sh_launches_torchrun_with_nproc_after_a_preflight_and_propagates_its_status(tmp_path, runner):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_command(bin_dir / "torchrun", f'printf "%s\\n" "$@" > {tmp_path}/torchrun.args\nexit 4\n')
    out = tmp_path / "out"
    path = f"{bin_dir}:{os.environ['PATH']}"
    proc = run_sh(tmp_path, "budget.max_steps=2", OUTPUT_DIR=str(out), NPROC="2", PATH=path, runner=runner)
    assert proc.returncode == 4
    argv = (tmp_path / "torchrun.args").read_text().splitlines()
    assert argv == ["--standalone", "--nproc-per-node", "2", "-m", "opdkit", "train", "--out", str(out), "-p", "none",
                    "-r", "", "-S", "budget.max_steps=2"]
    assert "run.sh: training failed (exit 4)" in proc.stderr and "no checkpoint survives" in proc.stderr
    assert not out.exists()  # the preflight (`opdkit train --check`) writes nothing

    (tmp_path / "torchrun.args").unlink()
    proc = run_sh(tmp_path, "budget.max_steps=two", OUTPUT_DIR=str(out), NPROC="2", PATH=path, runner=runner)
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
def test_run_sh_never_reports_success_without_a_valid_final_checkpoint(tmp_path, case, runner):
    body, expected = FAKE_TRAINERS[case]
    config = asset("student") / "config.json"
    fake_python = _fake_command(tmp_path / "python", (  # (the other commands, validate: the warm runner's python)
        f'if [[ "$1 $2 $3" == "-m opdkit train" ]]; then\n{body.format(config=config)}\nexit 0\nfi\n'
        f'exec {runner.python} "$@"\n'))
    out = tmp_path / "out"
    proc = run_sh(tmp_path, OUTPUT_DIR=str(out), PYTHON=str(fake_python))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "run.sh: done" not in proc.stdout


@pytest.mark.slow
def test_sigterm_to_run_sh_stops_the_trainer_cleanly_and_lists_survivors(tmp_path, runner):
    out = tmp_path / "out"
    # (the trainer started by the real interpreter, as always; run.sh's validation of the survivors in a child of
    # the warm runner)
    proc = subprocess.Popen(["bash", str(RUN_SH), *TINY, "budget.max_steps=200", "publish.every_steps=1"],
                            cwd=tmp_path, env=runner.env(real_trainer=True, OUTPUT_DIR=str(out)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = out / "metrics" / "train.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the trainer did not reach step 2"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert re.search(r"opdkit: training stopped by SIGTERM at step \d+; surviving valid checkpoints: "
                     r"checkpoint-", stderr)
    assert re.search(r"^training stopped by SIGTERM at step \d+ after [\d.]+s; ", stdout, re.M), stdout[-2000:]
    assert "run.sh: training stopped on SIGTERM (exit 143)" in stderr
    assert f"run.sh: surviving valid checkpoints in {out}/checkpoints: checkpoint-" in stderr
    ckpts = list_checkpoints(out / "checkpoints")
    assert ckpts and all(is_valid_checkpoint(c) == (True, "ok") for c in ckpts)
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["reason"]) == ("stopped", "SIGTERM")
    assert not any(p.name.startswith(".tmp") for p in (out / "checkpoints").iterdir())
    # the step in flight finished: it has a metrics row, the trainer state and the newest checkpoint
    state = trainer_state.peek(out)
    assert metric_steps(out)[-1] == run["step"] == state["step"] == int(ckpts[-1].name.split("-")[1])


# --- S1's formal replay: `bash run.sh` with only the orchestrator's variables -----------------------------------


@pytest.mark.slow
def test_bash_run_sh_with_only_the_orchestrators_variables_is_s1s_formal_replay(tmp_path, tmp_path_factory, runner):
    """On the real-scale fixture (a DAPO-shaped table, a qwen2 pair with the Qwen2.5 tokenizer): the wall budget
    is spent while loading (reserve = budget - 1 s), so the run publishes its step-0 export and ends there,
    having written the resolved config that a 12-hour run would train with."""
    fx = fixture_dir(tmp_path_factory)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    orchestrator = dict(STUDENT_MODEL=str(fx / "student"), TEACHER_MODEL=str(fx / "teacher"),
                        TRAIN_DATA=str(fx / "data" / "train.parquet"), OUTPUT_DIR=str(out), CKPT_DIR=str(ckpt),
                        MAX_WALL_TIME_SECONDS="2", DEADLINE_RESERVE_SECONDS="1", EXPERIMENT_NAME="s1 formal")
    # (the trainer started by the real interpreter: its start-up is part of what spends the budget; the validation
    # of its final checkpoint in a child of the warm runner)
    proc = run_sh(tmp_path, timeout=600, runner=runner, real_trainer=True, **orchestrator)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"recipe {RUN_SH.parent / 'recipes' / 's1_cosine.yaml'}" in proc.stdout
    from opdkit.config import load_config

    cfg = load_config(out / "config.yaml")
    assert mismatches(cfg, S1_FORMAL) == {}
    assert (cfg.student.path, cfg.teacher.path, cfg.data.train) == (str(fx / "student"), str(fx / "teacher"),
                                                                     str(fx / "data" / "train.parquet"))
    assert (cfg.budget.max_wall_time_s, cfg.budget.deadline_reserve_s, cfg.experiment_name) == (2.0, 1.0, "s1 formal")
    # CKPT_DIR holds the trainer state, under its own lock; OUTPUT_DIR the exports and the record
    assert cfg.runtime.state_dir == str(ckpt) and (ckpt / "trainer_state-0" / "meta.pt").is_file()
    assert not (out / "state").exists() and (out / "checkpoints" / "checkpoint-0").is_dir()
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["reason"], run["step"]) == ("completed", "wall_clock", 0)
    # the same OUTPUT_DIR and CKPT_DIR again: the run resumes from CKPT_DIR's state and has nothing to do (its trainer a
    # child of the warm runner: no budget is spent on this start-up, and a fresh interpreter's imports are spared)
    again = run_sh(tmp_path, timeout=600, runner=runner, **orchestrator)
    assert again.returncode == 0 and f"resuming from {ckpt / 'trainer_state-0'}" in again.stdout, again.stderr[-2000:]


def _argv_of_run_sh(tmp_path, *args, **env_vars) -> tuple[subprocess.CompletedProcess, list[str]]:
    """What run.sh runs: a fake python records `-m opdkit train ...` and stops there (exit 2); others run."""
    record = tmp_path / "train.argv"
    record.unlink(missing_ok=True)
    fake_python = _fake_command(tmp_path / "python", (
        f'if [[ "$1 $2 $3" == "-m opdkit train" ]]; then shift 2; printf "%s\\n" "$@" > {record}; exit 2; fi\n'
        f'exec {sys.executable} "$@"\n'))
    proc = run_sh(tmp_path, *args, PYTHON=str(fake_python), OUTPUT_DIR=str(tmp_path / "out"), **env_vars)
    return proc, record.read_text().splitlines() if record.exists() else []


def _resolve(argv: list[str]):
    from opdkit.cli import _config, build_parser

    return _config(build_parser().parse_args(argv))


def test_run_sh_picks_the_recipe_s1_formal_unless_recipe_says_otherwise(tmp_path):
    model = dict(STUDENT_MODEL=str(asset("student")), TEACHER_MODEL=str(asset("teacher")))
    _, argv = _argv_of_run_sh(tmp_path, **model)
    assert argv[argv.index("-r") + 1] == str(RUN_SH.parent / "recipes" / "s1_cosine.yaml")
    assert mismatches(_resolve(argv), S1_FORMAL) == {}
    _, argv = _argv_of_run_sh(tmp_path, RECIPE=str(RUN_SH.parent / "recipes" / "s1.yaml"), **model)
    assert mismatches(_resolve(argv), S1_BASELINE) == {}
    _, argv = _argv_of_run_sh(tmp_path, RECIPE="none", **model)
    assert argv[argv.index("-r") + 1] == "" and _resolve(argv).loss.name == "rkl"  # the built-in defaults
    _, argv = _argv_of_run_sh(tmp_path)  # no model: the embedded default, no recipe
    assert argv[argv.index("-r") + 1] == "" and _resolve(argv).budget.max_wall_time_s == 180.0


def test_run_sh_maps_the_opsd_switches_and_refuses_unknown_ones(tmp_path):
    recipe = str(RUN_SH.parent / "recipes" / "opsd_released.yaml")
    _, argv = _argv_of_run_sh(tmp_path, RECIPE=recipe)
    assert mismatches(_resolve(argv), OPSD_RELEASED) == {}
    # each switch at its released value changes nothing
    released = dict(OPSD_PAD_SIDE="right", OPSD_STUDENT_PROMPT="paper", OPSD_TEACHER_CONTEXT="solution",
                    OPSD_CLIP_MODE="entry", OPSD_DATA_SELECT="none", OPSD_WAVG_LAST="0")
    _, argv = _argv_of_run_sh(tmp_path, RECIPE=recipe, **released)
    assert mismatches(_resolve(argv), OPSD_RELEASED) == {} and "data.pad_side=right" in argv
    # the seed's rejected bundle (per-token clip + left padding + the eval prompt), and a trailing argument wins
    _, argv = _argv_of_run_sh(tmp_path, "loss.clip_tau=0.1", RECIPE=recipe, OPSD_CLIP_MODE="token",
                              OPSD_PAD_SIDE="left", OPSD_STUDENT_PROMPT="eval", OPSD_TEACHER_CONTEXT="cot")
    cfg = _resolve(argv)
    assert (cfg.loss.clip, cfg.data.pad_side, cfg.runtime.alignment_check, cfg.data.prompt_format,
            cfg.data.teacher_context, cfg.loss.clip_tau) == ("token", "left", True, "opsd_eval", "cot", 0.1)
    assert cfg.data.enable_thinking == cfg.eval.enable_thinking  # the eval prompt as the benchmark renders it
    # in an environment larger than a pipe's buffer, listed after the switch (run.sh piped `compgen -e` into
    # `grep -q`: grep's early exit ended compgen with SIGPIPE, pipefail made the test false, and every switch was
    # dropped without a word; CI saw it once)
    crowd = {f"ZZ_{i:06d}": "1" for i in range(12000)}
    _, argv = _argv_of_run_sh(tmp_path, RECIPE=recipe, OPSD_CLIP_MODE="token", **crowd)
    assert "loss.clip=token" in argv and _resolve(argv).loss.clip == "token"
    for bad, needle in ((dict(OPSD_PAD_SIDE="middle"), "OPSD_PAD_SIDE=middle: expected one of right, left"),
                        (dict(OPSD_PADSIDE="left"), "unknown OPSD switch OPSD_PADSIDE"),
                        (dict(OPSD_WAVG_LAST="5"), "tail weight averaging is not implemented")):
        proc, argv = _argv_of_run_sh(tmp_path, RECIPE=recipe, **bad)
        assert proc.returncode == 2 and argv == [], proc.stderr
        assert proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr


# --- the locks: CKPT_DIR's, and the GPU workload lock (shared by training, exclusive for evaluation) ------------


def _hold(code: str, *args: str) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", f"import sys, time\n{code}\nprint('locked', flush=True)\n"
                               "time.sleep(120)", *args], stdout=subprocess.PIPE, text=True, env=env())
    assert holder.stdout.readline().strip() == "locked"
    return holder


def _release(holder: subprocess.Popen) -> None:
    holder.kill()
    holder.wait()


def test_run_sh_exits_75_when_another_run_holds_ckpt_dir(tmp_path, runner):
    ckpt = tmp_path / "ckpt"
    holder = _hold("from opdkit.persist.fsutil import OutputLock\nOutputLock(sys.argv[1]).acquire()", str(ckpt))
    try:
        proc = run_sh(tmp_path, "budget.max_steps=2", OUTPUT_DIR=str(tmp_path / "out"), CKPT_DIR=str(ckpt), timeout=120,
                      runner=runner)
    finally:
        _release(holder)
    assert proc.returncode == 75, proc.stderr
    assert proc.stderr.splitlines() == [f"opdkit: trainer state directory {ckpt} is in use by another run "
                                        f"(pid={holder.pid} host={os.uname().nodename}); wait for it to finish or "
                                        "choose another trainer state directory"]
    assert not (tmp_path / "out").exists()


GPU = ["runtime.device_lock=always"]  # the lock applies on CUDA devices; `always` takes it on this CPU machine too


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_run_sh_exits_75_while_an_evaluation_holds_the_gpu(tmp_path, nproc, runner):
    lock = tmp_path / "gpu.lock"
    holder = _hold("from opdkit.persist.fsutil import DeviceLock\nDeviceLock(False, sys.argv[1]).acquire()", str(lock))
    try:
        proc = run_sh(tmp_path, *TINY, *GPU, "budget.max_steps=2", OUTPUT_DIR=str(tmp_path / "out"), NPROC=nproc,
                      OPDKIT_GPU_LOCK=str(lock), timeout=120, runner=runner)
    finally:
        _release(holder)
    assert proc.returncode == 75, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert f"the GPU workload lock {lock} is taken: an evaluation holds it (pid={holder.pid}" in line
    assert not (tmp_path / "out").exists()


def _eval(runner, tmp_path, lock: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python -m opdkit eval`` of the student, with the warm runner's python (a child of the runner)."""
    return subprocess.run([runner.python, "-m", "opdkit", "eval", "--model", str(asset("student")), "--out",
                           str(tmp_path / "eval.json"), "-p", "none", "--quiet", *sum((["-S", kv] for kv in
                           [*GPU, "eval.max_questions=2", "eval.n_samples=1", "eval.max_new_tokens=8", *extra]), [])],
                          cwd=tmp_path, env=runner.env(OPDKIT_GPU_LOCK=str(lock)), text=True, capture_output=True,
                          timeout=300)


def test_opdkit_eval_exits_75_while_training_holds_the_gpu_and_runs_once_it_is_released(tmp_path, runner):
    lock = tmp_path / "gpu.lock"
    holders = [_hold("from opdkit.persist.fsutil import DeviceLock\nDeviceLock(True, sys.argv[1]).acquire()", str(lock))
               for _ in range(2)]  # two trainings share the GPU
    try:
        proc = _eval(runner, tmp_path, lock)
        assert proc.returncode == 75, proc.stderr
        assert proc.stderr.splitlines()[-1].startswith(f"opdkit: the GPU workload lock {lock} is taken: training runs "
                                                       "hold it (shared)")
        assert not (tmp_path / "eval.json").exists()
        # a third training may join them
        out = tmp_path / "out"
        proc = run_sh(tmp_path, *TINY, *GPU, "budget.max_steps=1", "publish.every_steps=1", OUTPUT_DIR=str(out),
                      OPDKIT_GPU_LOCK=str(lock), MAX_WALL_TIME_SECONDS="0", runner=runner)
        assert proc.returncode == 0, proc.stderr[-2000:]
    finally:
        for h in holders:
            _release(h)
    # run.sh returns once its trainer has exited: the GPU is free for an evaluation of its checkpoint at once
    proc = _eval(runner, tmp_path, lock)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "eval.json").read_text())["n_questions"] == 2


# --- where the checkpoints go with only the orchestrator's variables; the evaluator and other GPU processes ------


def _out_of_run_sh(tmp_path: Path, **env_vars) -> tuple[subprocess.CompletedProcess, str]:
    """run.sh's output line and the --out it hands the trainer (a fake python records it and stops there)."""
    record = tmp_path / "train.argv"
    fake_python = _fake_command(tmp_path / "python", (
        f'if [[ "$1 $2 $3" == "-m opdkit train" ]]; then shift 2; printf "%s\\n" "$@" > {record}; exit 2; fi\n'
        f'exec {sys.executable} "$@"\n'))
    proc = run_sh(tmp_path, PYTHON=str(fake_python), **env_vars)
    argv = record.read_text().splitlines()
    return proc, argv[argv.index("--out") + 1]


def test_without_output_dir_run_sh_writes_under_the_contracts_out_when_it_is_there_else_under_dot_out(tmp_path):
    contract = tmp_path / "contract_out"  # /out on the orchestrator's machine
    contract.mkdir()
    proc, out = _out_of_run_sh(tmp_path, OPDKIT_CONTRACT_OUT=str(contract))
    assert out == str(contract)
    assert (f"run.sh: OUTPUT_DIR unset: writing to {contract} (the contract's layout: checkpoints in "
            f"{contract}/checkpoints/)") in proc.stdout
    missing = tmp_path / "no_such_dir"
    proc, out = _out_of_run_sh(tmp_path, OPDKIT_CONTRACT_OUT=str(missing))
    assert out == "out"
    assert (f"run.sh: OUTPUT_DIR unset and {missing} does not exist: writing to ./out "
            "(set OUTPUT_DIR to choose)") in proc.stdout
    proc, out = _out_of_run_sh(tmp_path, OPDKIT_CONTRACT_OUT=str(contract), OUTPUT_DIR=str(tmp_path / "mine"))
    assert out == str(tmp_path / "mine") and "OUTPUT_DIR unset" not in proc.stdout


def _fake_nvidia_smi(bin_dir: Path, apps: str) -> Path:
    """An nvidia-smi that lists ``apps`` (lines of pid, name, gpu uuid; $PPID: the process that asks) on GPU 0."""
    bin_dir.mkdir(exist_ok=True)
    return _fake_command(bin_dir / "nvidia-smi", (
        'case "$*" in\n'
        f'  *query-compute-apps*) printf "%s\\n" {apps} ;;\n'
        '  *query-gpu*) printf "0, GPU-aaaa\\n1, GPU-bbbb\\n" ;;\n'
        '  *) exit 9 ;;\nesac\n'))


def _eval_with_path(runner, tmp_path: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    """``python -m opdkit eval`` with the warm runner's python (a child of the runner: nvidia-smi's $PPID)."""
    return subprocess.run([runner.python, "-m", "opdkit", "eval", "--model", str(asset("student")), "--out",
                           str(tmp_path / "eval.json"), "-p", "none", "--quiet", *sum((["-S", kv] for kv in
                           [*GPU, "eval.max_questions=2", "eval.n_samples=1", "eval.max_new_tokens=8"]), [])],
                          cwd=tmp_path, text=True, capture_output=True, timeout=300,
                          env=runner.env(OPDKIT_GPU_LOCK=str(tmp_path / "gpu.lock"), CUDA_VISIBLE_DEVICES="",
                                         PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"))


def test_opdkit_eval_exits_75_naming_another_compute_process_on_its_gpu_and_ignores_itself_and_other_gpus(tmp_path,
                                                                                                          runner):
    bin_dir = tmp_path / "bin"
    _fake_nvidia_smi(bin_dir, '"4242, /usr/bin/python3 -m vllm.entrypoints.openai.api_server, GPU-aaaa"')
    proc = _eval_with_path(runner, tmp_path, bin_dir)
    assert proc.returncode == 75, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line == ("opdkit: GPU 0 is in use by another compute process (pid 4242: /usr/bin/python3 -m "
                    "vllm.entrypoints.openai.api_server); an evaluation starts once it has exited "
                    "(nvidia-smi lists it)")
    assert not (tmp_path / "eval.json").exists()
    # the process asking (the evaluation itself) and a process on another GPU do not count
    _fake_nvidia_smi(bin_dir, '"$PPID, python3, GPU-aaaa" "777, python3 train.py, GPU-bbbb"')
    proc = _eval_with_path(runner, tmp_path, bin_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "eval.json").read_text())["n_questions"] == 2

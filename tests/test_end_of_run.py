"""The end of a run, as real processes: a stop signal to the whole process group at any moment of a save
(the trainer state or the export; one process, run.sh, a 2-rank torchrun) never costs a save; a stop signal
ends a long rollout between decode steps; a wall budget that the first step would overrun ends with a valid
checkpoint inside the budget; a helper process forked with the trainer's handlers stops as it would without.

Slow saves and forked helpers are planted from outside the library: a ``sitecustomize`` on the trainer's path
makes every write of the trainer state's pieces (``tensor_files._pwrite_all``) or of the export's weights
(``publish._write_safetensors``) sleep, and marks when the first began. Long rollouts: the embedded student
with its end-of-answer id moved to one it never emits (every answer runs to the token cap).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from opdkit.embedded import asset
from opdkit.persist import trainer_state
from procs import env
from signal_harness import REPO, OpdkitRunner, gone, leftovers, validate, wait_for, write_sitecustomize

TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "runtime.threads=1", "optim.schedule=constant", "budget.max_wall_time_s=0", "tracking=none"]
SAVES = ["budget.max_steps=8", "publish.every_steps=2"]  # the signal arrives long before the step horizon
FAULTS = {
    "slow_state": """
        import opdkit.persist.tensor_files as tf
        real_pwrite = tf._pwrite_all
        def slow_pwrite(*a, **k):  # each piece of the trainer state takes a while: a save of ~3.5 s (116 pieces
            mark("state")  # on 4 writer threads; two ranks: ~100 each), past the latest signal of CASES (2.5 s in)
            time.sleep(0.12)
            return real_pwrite(*a, **k)
        tf._pwrite_all = slow_pwrite
    """,
    "slow_export": """
        import opdkit.persist.publish as pub
        real_write = pub._write_safetensors
        def slow_write(path, tensors):  # the export's weights: 2 s before and 2 s after they are written
            mark("export")
            time.sleep(2.0)
            record = real_write(path, tensors)
            time.sleep(2.0)
            return record
        pub._write_safetensors = slow_write
    """,
    "teacher_dies": """
        import signal
        import opdkit.step as o
        real_score, calls = o.score_batch, []
        def dying_teacher(*a, **k):  # step 2: the group's SIGTERM arrives, and stops the teacher's engine process too
            calls.append(1)
            if len(calls) == 2:
                os.killpg(0, signal.SIGTERM)
                time.sleep(0.5)
                raise RuntimeError("EngineDeadError: EngineCore encountered an issue "
                                   "(the teacher's engine process stopped)")
            return real_score(*a, **k)
        o.score_batch = dying_teacher
    """,
    "helper": """
        import opdkit.engines.select as sel
        real_make = sel.make_engine
        def make_and_fork(*a, **k):  # an engine that forks a helper process (as vLLM's do), with no handlers of its own
            engine = real_make(*a, **k)
            pid = os.fork()
            if pid == 0:
                try:
                    while True:
                        time.sleep(0.1)
                finally:
                    os._exit(0)
            mark(f"helper-{pid}")
            return engine
        sel.make_engine = make_and_fork
    """,
}


def fault_env(tmp_path: Path, *faults: str, **extra) -> dict:
    site, marks = tmp_path / "site", tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    code = textwrap.dedent("""
        import os, pathlib, time
        MARKS = pathlib.Path(os.environ["OPDKIT_TEST_MARKS"])
        def mark(name):
            p = MARKS / name
            if not p.exists():
                p.write_text(str(os.getpid()))
    """) + "".join(textwrap.dedent(FAULTS[f]) for f in faults)
    write_sitecustomize(site, code)
    return env(PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), OPDKIT_TEST_MARKS=str(marks), **extra)


def train_args(out: Path, *overrides: str) -> list[str]:
    return ["train", "--out", str(out), "-p", "none", "--quiet", *[x for o in overrides for x in ("-S", o)]]


def train_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "opdkit", *train_args(out, *overrides)]


def mark(tmp_path: Path, name: str) -> Path:
    return tmp_path / "marks" / name


def resume_and_finish(runner: OpdkitRunner, out: Path, *overrides: str, steps: int = 8) -> None:
    """A plain rerun resumes from what survived and ends with exit 0 and valid checkpoints, the last at ``steps``."""
    code, stdout, stderr = runner.run(train_args(out, *overrides), out.parent / "rerun")
    assert code == 0, stderr[-3000:]
    assert "resuming from" in stdout, stdout[-3000:]
    assert validate(out)[-1] == f"checkpoint-{steps}" and not leftovers(out)


# --- a stop signal to the whole process group during a save ----------------------------------------------------------

CASES = {  # what is slow, seconds into its save when the group is signalled, the signal, how it is launched
    "state-early-SIGTERM": ("state", 0.3, signal.SIGTERM, "train"),
    "state-late-SIGINT": ("state", 2.5, signal.SIGINT, "train"),
    "state-run.sh-SIGTERM": ("state", 1.5, signal.SIGTERM, "run.sh"),
    "export-early-SIGTERM": ("export", 0.3, signal.SIGTERM, "train"),
    "export-late-run.sh-SIGINT": ("export", 3.0, signal.SIGINT, "run.sh"),
}


def launch(tmp_path: Path, out: Path, launcher: str, faults: tuple[str, ...], nproc: int, runner: OpdkitRunner
           ) -> subprocess.Popen:
    """The run in a session of its own (its process group: the trainer, run.sh, torchrun and the ranks). run.sh's
    trainer is started as always (the real interpreter, or torchrun); its preflight (NPROC > 1) and its validation
    of the survivors run in children of the warm ``runner``, each spared a fresh interpreter's imports."""
    args = [*TINY, *SAVES]
    if launcher == "train":
        cmd, extra = train_cmd(out, *args), {}
    else:
        cmd, extra = ["bash", str(REPO / "run.sh"), *args], dict(OUTPUT_DIR=str(out), NPROC=str(nproc),
                                                                 PYTHON=str(runner.helpers_python))
    return subprocess.Popen(cmd, cwd=tmp_path, env=fault_env(tmp_path, *faults, **extra), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def signal_the_group_during_a_save(tmp_path: Path, what: str, offset: float, sig: int, launcher: str,
                                   faults: tuple[str, ...], runner: OpdkitRunner,
                                   nproc: int = 1) -> tuple[subprocess.Popen, str, Path]:
    out = tmp_path / "out"
    proc = launch(tmp_path, out, launcher, faults, nproc, runner)
    try:
        wait_for(mark(tmp_path, what).exists, proc, 300, f"a {what} save", poll=0.02)
        time.sleep(offset)
        os.killpg(proc.pid, sig)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc, stderr, out


@pytest.mark.parametrize("case", list(CASES))
def test_a_stop_signal_to_the_process_group_during_a_save_never_costs_it(runner, tmp_path, case):
    what, offset, sig, launcher = CASES[case]
    proc, stderr, out = signal_the_group_during_a_save(tmp_path, what, offset, sig, launcher, (f"slow_{what}",),
                                                       runner)
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert stderr.count("received: stopping") == 1  # the group's signal and run.sh's relay: one stop
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["reason"]) == ("stopped", signal.Signals(sig).name)
    # the save in flight completed (the step-2 state, checkpoint-2), nothing half-written is left
    names = validate(out)
    assert names and names[-1] == f"checkpoint-{run['step']}" and trainer_state.peek(out)["step"] == run["step"] >= 2
    assert not leftovers(out)
    if launcher == "run.sh":
        # not "killed": the trainer stopped on it (its run.json says so)
        assert f"run.sh: training stopped on {signal.Signals(sig).name} (exit {128 + sig})" in stderr
    resume_and_finish(runner, out, *TINY, *SAVES)


def test_a_helper_forked_with_the_trainers_handlers_stops_on_the_groups_signal_and_the_save_completes(runner, tmp_path):
    proc, stderr, out = signal_the_group_during_a_save(tmp_path, "state", 1.0, signal.SIGTERM, "train",
                                                       ("slow_state", "helper"), runner)
    (helper,) = [int(p.name.split("-")[1]) for p in (tmp_path / "marks").glob("helper-*")]
    assert gone(helper), "the helper inherited the trainer's handlers and outlived the stop"
    assert proc.returncode == 143, stderr[-3000:]
    assert stderr.count("received: stopping") == 1  # the trainer's; the helper did not take part
    run = json.loads((out / "run.json").read_text())
    assert validate(out)[-1] == f"checkpoint-{run['step']}" and not leftovers(out)
    resume_and_finish(runner, out, *TINY, *SAVES)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["state", "export"])
def test_a_stop_signal_to_the_group_of_a_two_rank_torchrun_during_a_save_never_costs_it(runner, tmp_path, what):
    proc, stderr, out = signal_the_group_during_a_save(tmp_path, what, 1.0, signal.SIGTERM, "run.sh", (f"slow_{what}",),
                                                       runner, nproc=2)
    assert proc.returncode == 143, stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["reason"]) == ("stopped", "SIGTERM")
    assert validate(out)[-1] == f"checkpoint-{run['step']}" and trainer_state.peek(out)["step"] == run["step"] >= 2
    assert not leftovers(out)
    resume_and_finish(runner, out, *TINY, *SAVES)  # in one process: the state of two ranks resumes under one


def test_a_teacher_that_stops_on_the_same_signal_abandons_the_step_and_the_last_complete_one_is_saved(runner, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(train_cmd(out, *TINY, *SAVES), cwd=tmp_path, env=fault_env(tmp_path, "teacher_dies"),
                          text=True, capture_output=True, timeout=600, start_new_session=True)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "step 2: the teacher failed after SIGTERM (RuntimeError: EngineDeadError" in proc.stdout
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["step"], run["stop"]["abandoned_step"]) == ("stopped", 1, True)
    state = trainer_state.peek(out)
    assert state["step"] == 1 and state["data_pos"] == 2  # step 2's prompts: not used
    assert validate(out) == ["checkpoint-1"] and not leftovers(out)
    resume_and_finish(runner, out, *TINY, *SAVES)


# --- a long rollout: a stop signal, and a wall budget the first step would overrun ------------------------------------


@pytest.fixture(scope="module")
def long_student(tmp_path_factory) -> Path:
    """The embedded student, stopping at an id it never emits: every answer runs to the token cap."""
    import shutil

    d = tmp_path_factory.mktemp("long") / "student"
    shutil.copytree(asset("student"), d)
    g = json.loads((d / "generation_config.json").read_text())
    g["eos_token_id"] = 3  # <unk>
    (d / "generation_config.json").write_text(json.dumps(g))
    return d


LONG = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "runtime.threads=1", "optim.schedule=constant",
        "tracking=none", "rollout.max_new_tokens=2500"]


def test_a_stop_signal_ends_a_long_rollout_at_its_next_token_and_saves_the_last_complete_step(tmp_path, long_student):
    out = tmp_path / "out"
    # 5,000 tokens: a rollout of well over twice the stop's seconds on a loaded 2-core machine (at 2,500 one took
    # 14.8 s beside the other test worker, and the stop with its saves 12.4 s). Two rows a step, not LONG's eight:
    # the rollout is still 5,000 decode steps (19 s beside another test, 40 s with eight rows; the stop 1.8 s),
    # while step 1's scoring and update, which the stop never meets, shrink fourfold (eight rows: 66 s of 120)
    args = [*LONG, f"student.path={long_student}", "budget.max_wall_time_s=0", "budget.max_steps=3",
            "publish.every_steps=100", "rollout.max_new_tokens=5000", "rollout.prompts_per_step=1",
            "rollout.samples_per_prompt=2"]
    proc = subprocess.Popen(train_cmd(out, *args), cwd=tmp_path, env=env(PYTHONPATH=str(REPO)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    metrics = out / "metrics" / "train.jsonl"
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, proc, 600, "step 1")
        time.sleep(3.0)  # step 2's rollout is under way
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert proc.returncode == 143, stderr[-3000:]
    assert [r["step"] for r in rows] == [1] and rows[0]["truncated_frac"] == 1.0
    assert "step 2 abandoned during its rollout" in stdout and "(SIGTERM)" in stdout
    # a rollout takes rows[0]["time_rollout_s"] (tens of seconds here); the stop, with its saves, a few
    assert took < min(15.0, rows[0]["time_rollout_s"] / 2), (took, rows[0]["time_rollout_s"])
    print(f"SIGTERM 3 s into a {rows[0]['time_rollout_s']:.0f} s rollout: exited after {took:.1f} s")
    run = json.loads((out / "run.json").read_text())
    assert run["stop"]["abandoned_step"] and run["step"] == 1 and trainer_state.peek(out)["step"] == 1
    assert validate(out) == ["checkpoint-1"] and not leftovers(out)


def test_a_wall_budget_the_first_step_would_overrun_ends_with_a_valid_checkpoint_inside_it(tmp_path, long_student):
    # 20 s: the start-up (imports, models, the write probe) takes 3-8 s, so the first step's rollout is under way
    # when the deadline (budget - reserve) comes; what is timed below is the reserve's, whatever the budget
    out, budget = tmp_path / "out", 20.0
    args = [*LONG, f"student.path={long_student}", f"budget.max_wall_time_s={budget}", "budget.deadline_reserve_s=3",
            "rollout.max_new_tokens=8000"]  # a first step of minutes, whatever the machine's load
    t0 = time.monotonic()
    proc = subprocess.run(train_cmd(out, *args), cwd=tmp_path, env=env(PYTHONPATH=str(REPO)), text=True,
                          capture_output=True, timeout=600)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["reason"], run["step"]) == ("completed", "wall_clock", 0)
    assert run["stop"]["abandoned_step"] and "step 1 abandoned during its rollout" in proc.stdout
    # the last checkpoint was complete inside the budget, start-up included; the process ended right after it
    assert run["ended_s"] <= budget - 1.0 and took <= budget + 5.0, (run["ended_s"], took)
    assert sorted(s["what"] for s in run["saves"]) == ["export", "state"]
    assert validate(out) == ["checkpoint-0"] and not leftovers(out)
    print(f"budget {budget:g} s: the first step's rollout abandoned, saves ended at {run['ended_s']:.1f} s, "
          f"process ended after {took:.1f} s; reserved: {run['stop']['saves']}")

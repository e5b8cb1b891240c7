"""Resume: an interrupted run continues exactly where its state left off and ends with the same
weights as an uninterrupted one; SIGKILL of the real trainer process at several points leaves
only complete checkpoints, and a rerun finishes with exit 0; the end of a run is published once;
a finished run is not trained again; a foreign or incompatible output directory is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opdkit import train as train_mod
from opdkit.config import load_config
from opdkit.persist import trainer_state
from opdkit.persist.checkpoints import is_valid_checkpoint
from opdkit.persist.fsutil import list_checkpoints
from opdkit.setup import RunError
from opdkit.train import train
from procs import env

REPO = Path(__file__).resolve().parents[1]
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "runtime.threads=1", "budget.max_wall_time_s=0", "optim.schedule=cosine"]


def cfg(*overrides: str):
    return load_config(None, [*TINY, *overrides])


def quiet_train(config, out: Path) -> tuple[object, str]:
    logs: list[str] = []
    result = train(config, out, log=logs.append, progress=False)
    return result, "\n".join(logs)


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs: max |diff| {(wa[k] - wb[k]).abs().max()}"


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, str]:
    """4 steps in one go, a checkpoint every 2 (the last step is also a periodic publish)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    result, logs = quiet_train(cfg("budget.max_steps=4", "publish.every_steps=2"), out)
    assert (result.status, result.reason, result.step) == ("completed", "step_horizon", 4)
    return out, logs


def test_the_final_step_is_published_once_when_it_is_also_a_periodic_publish(uninterrupted):
    out, logs = uninterrupted
    assert logs.count("published ") == 2 and "replacing existing" not in logs
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["checkpoint-2", "checkpoint-4"]
    assert [r["step"] for r in metric_rows(out)] == [1, 2, 3, 4]


def test_an_interrupted_and_resumed_run_ends_with_the_same_weights(tmp_path, uninterrupted):
    ref, _ = uninterrupted
    out = tmp_path / "out"
    # the first start ends at step 2 (same lr schedule horizon as the reference) ...
    first, _ = quiet_train(cfg("budget.max_steps=2", "budget.schedule_steps=4", "publish.every_steps=2",
                               "tracking=dvclive"), out)
    assert first.step == 2
    # ... after which a killed attempt left a step-3 line and a torn step-4 line behind (in DVCLive's log too)
    with (out / "metrics" / "train.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "elapsed_s": 500.0}) + "\n" + '{"step": 4, "elaps')
    with (out / "dvclive" / "plots" / "metrics" / "loss.tsv").open("a") as f:
        f.write("3\t999.0\n4\t9")
    result, logs = quiet_train(cfg("budget.max_steps=4", "budget.schedule_steps=4", "publish.every_steps=2",
                                   "tracking=dvclive"), out)
    assert result.step == 4
    assert "resuming from" in logs and "step 2, 500.0s of the wall budget already spent" in logs
    assert_same_weights(out / "checkpoints" / "checkpoint-4", ref / "checkpoints" / "checkpoint-4")
    rows, ref_rows = metric_rows(out), metric_rows(ref)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # stale and torn lines dropped, new ones appended
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref_rows]  # the same samples, step by step
    assert rows[2]["elapsed_s"] > 500.0  # the wall budget counts the time the lost steps took
    # DVCLive's history is train.jsonl's, step by step (the killed attempt's rows gone), and run.json says so
    loss_tsv = (out / "dvclive" / "plots" / "metrics" / "loss.tsv").read_text().splitlines()
    assert loss_tsv == ["step\tloss"] + [f"{r['step']}\t{r['loss']!r}" for r in rows]
    assert json.loads((out / "run.json").read_text())["tracking"] == {"kind": "dvclive", "error": None}


def test_rerunning_a_finished_run_returns_at_once_without_training(uninterrupted, monkeypatch):
    out, _ = uninterrupted
    before = (out / "metrics" / "train.jsonl").read_text()

    def no_build(*a, **k):
        raise AssertionError("a finished run must not load models again")

    monkeypatch.setattr(train_mod, "build_run", no_build)
    result, logs = quiet_train(cfg("budget.max_steps=4", "publish.every_steps=2"), out)
    assert (result.status, result.reason, result.step) == ("completed", "step_horizon", 4)
    assert "nothing to do" in logs
    assert (out / "metrics" / "train.jsonl").read_text() == before


def test_a_run_that_ended_on_its_wall_budget_has_nothing_to_do_on_a_rerun_with_that_budget(uninterrupted):
    """The loop stops before a step expected to end past the wall budget, so the elapsed time a run saved can fall
    short of it: a rerun then has nothing to do by what run.json recorded (completed on the wall clock at the
    state's step) and the state's budget, not by the elapsed time alone (persist.rundir.ended_on_the_wall_clock).
    A larger budget trains on; another end, step or no state does not count."""
    from opdkit.persist.rundir import ended_on_the_wall_clock

    out, _ = uninterrupted
    state = trainer_state.peek(out)  # its config as saved (the round trip through the state file)
    c, step = cfg("budget.max_steps=4", "publish.every_steps=2"), state["step"]
    ended = {"status": "completed", "reason": "wall_clock", "step": step}
    assert ended_on_the_wall_clock(ended, state, step, c)
    assert not ended_on_the_wall_clock(ended, state, step, cfg("budget.max_steps=8", "publish.every_steps=2"))
    assert not ended_on_the_wall_clock({**ended, "status": "stopped", "reason": "SIGTERM"}, state, step, c)
    assert not ended_on_the_wall_clock({**ended, "reason": "step_horizon"}, state, step, c)
    assert not ended_on_the_wall_clock({**ended, "step": step - 1}, state, step, c)
    assert not ended_on_the_wall_clock({}, state, step, c)
    assert not ended_on_the_wall_clock(ended, None, step, c)


def test_resuming_with_other_params_or_into_foreign_checkpoints_is_refused_untouched(tmp_path, uninterrupted):
    out, _ = uninterrupted
    before = snapshot(out)
    with pytest.raises(RunError, match=r"other params \(loss.name: 'rkl' -> 'k1'\)"):
        train(cfg("budget.max_steps=4", "loss.name=k1"), out, log=lambda s: None, progress=False)
    assert snapshot(out) == before
    foreign = tmp_path / "foreign"  # checkpoints without the trainer state that made them
    shutil.copytree(out / "checkpoints", foreign / "checkpoints")
    before = snapshot(foreign)
    with pytest.raises(RunError, match="no trainer state"):
        train(cfg("budget.max_steps=4"), foreign, log=lambda s: None, progress=False)
    assert snapshot(foreign) == before


def test_checkpoints_beside_a_damaged_run_json_are_refused_naming_run_json_and_the_way_back(tmp_path, uninterrupted):
    """Without a trainer state, run.json's run_id is what tells this run's checkpoints from another's. A damaged
    run.json was reported as foreign checkpoints ("remove the old checkpoints"); the error now names run.json and
    the run_id to write back, nothing is changed, and with it written back the run continues."""
    src, _ = uninterrupted
    out = tmp_path / "out"
    shutil.copytree(src / "checkpoints", out / "checkpoints")
    (out / "run.json").write_text('{"status": "compl')  # cut short by something outside opdkit
    rid = json.loads((src / "run.json").read_text())["run_id"]
    before = snapshot(out)
    with pytest.raises(RunError) as e:
        train(cfg("budget.max_steps=4"), out, log=lambda s: None, progress=False)
    assert f"{out / 'run.json'} cannot be read (JSONDecodeError" in str(e.value)
    assert f'write {{"run_id": "{rid}"}} into {out / "run.json"}' in str(e.value)
    assert "remove the old checkpoints" not in str(e.value) and snapshot(out) == before
    (out / "run.json").write_text(json.dumps({"run_id": rid}))
    result, logs = quiet_train(cfg("budget.max_steps=4", "publish.every_steps=2"), out)
    assert "checkpoint-4 is newer than the trainer state" in logs and "published " not in logs  # replayed, kept
    assert (result.step, result.final_checkpoint) == (4, "checkpoint-4")
    assert_same_weights(out / "checkpoints" / "checkpoint-4", src / "checkpoints" / "checkpoint-4")


def test_the_record_of_a_start_that_saved_nothing_is_taken_over_only_by_the_same_run(tmp_path, uninterrupted):
    """A start killed before its first save leaves config.yaml, run.json and metrics rows but no state or
    checkpoint; the next start begins again and takes that record over (run_id, rows dropped, wall time
    counted). Another config took it over too, dropping the rows of a run that was not its own; now it is
    refused as a resume with other params is, and a config.yaml opdkit did not write is not overwritten."""
    from opdkit.train import preflight

    src, _ = uninterrupted
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.yaml", "run.json", "metrics"):
        (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, out / name)
    before = snapshot(out)
    with pytest.raises(RunError, match=r"holds a run \(step 4\) with other params \(loss.name: 'rkl' -> 'k1'\).*"
                                       r"saved no trainer state and no checkpoint: to start this run there instead, "
                                       r"move away its record \(config.yaml, run.json, metrics\)"):
        train(cfg("budget.max_steps=4", "loss.name=k1"), out, log=lambda s: None, progress=False)
    assert snapshot(out) == before
    preflight(cfg("budget.max_steps=9", "publish.every_steps=3"), out)  # the same run, its budget changed: fine
    (out / "config.yaml").write_text("notes: [unclosed\n")
    with pytest.raises(RunError, match=r"config.yaml is not a params file opdkit wrote \(ParserError: .*move it away"):
        preflight(cfg("budget.max_steps=4"), out)


def test_a_wall_budget_spent_before_the_first_step_still_publishes_and_ends_cleanly(tmp_path):
    out = tmp_path / "out"
    c = cfg("budget.max_wall_time_s=1.0", "budget.deadline_reserve_s=0.999", "optim.schedule=constant")
    result, _ = quiet_train(c, out)  # start-up alone takes longer than the 1 ms left
    assert (result.reason, result.step) == ("wall_clock", 0)
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["checkpoint-0"]
    assert is_valid_checkpoint(out / "checkpoints" / "checkpoint-0") == (True, "ok")
    assert trainer_state.peek(out)["step"] == 0
    again, logs = quiet_train(c, out)
    assert (again.reason, again.step) == ("wall_clock", 0) and "nothing to do" in logs


# --- SIGKILL of the real trainer process ----------------------------------------------------

KILL_ARGS = [*TINY, "budget.max_steps=6", "publish.every_steps=2", "publish.keep=2"]


def steps_logged(out: Path) -> int:
    try:
        return sum(1 for ln in (out / "metrics" / "train.jsonl").read_text().splitlines() if ln.endswith("}"))
    except FileNotFoundError:
        return 0


def exporting(out: Path, step: int) -> bool:
    try:
        return any(n.startswith(f".tmp-checkpoint-{step}-") for n in os.listdir(out / "checkpoints"))
    except FileNotFoundError:
        return False


def child_of(pid: int) -> int | None:
    """The trainer run.sh started (a child of ``pid`` running ``opdkit train``, not its --check or a
    short-lived helper of the script such as a pipeline's grep)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == pid and b"opdkit" in argv and b"train" in argv and b"--check" not in argv:
            return int(stat.parent.name)
    return None


def wait_then_kill(proc: subprocess.Popen, victim: int, when, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not when():
        assert proc.poll() is None, f"the trainer ended (exit {proc.returncode}) before the kill point"
        assert time.monotonic() < deadline, "the kill point never came"
        time.sleep(0.002)
    os.kill(victim, signal.SIGKILL)


@pytest.fixture(scope="module")
def kill_reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kill_reference") / "out"
    quiet_train(load_config(None, KILL_ARGS), out)
    return out


# (how the trainer is started, when it is killed, whether a trainer state exists by then)
KILL_POINTS = {
    "after step 1, before any state": ("python", lambda out: steps_logged(out) >= 1, False),
    "after step 3, via run.sh": (
        "run.sh", lambda out: steps_logged(out) >= 3 and (out / "checkpoints" / "checkpoint-2").is_dir(), True),
    "while checkpoint-4 is being exported": ("python", lambda out: exporting(out, 4) or steps_logged(out) >= 5, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_then_rerun_resumes_and_finishes_with_only_complete_checkpoints(tmp_path, kill_reference, point,
                                                                                runner):
    how, when, has_state = KILL_POINTS[point]
    out = tmp_path / "out"
    if how == "python":
        proc = subprocess.Popen([sys.executable, "-m", "opdkit", "train", "--out", str(out), "--quiet",
                                 *[x for a in KILL_ARGS for x in ("-S", a)]],
                                cwd=tmp_path, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        victim = proc.pid
    else:
        # (its trainer started by the real interpreter, as always; its validation of the survivors in a child of the
        # warm runner, spared a fresh interpreter's imports)
        proc = subprocess.Popen(["bash", str(REPO / "run.sh"), *KILL_ARGS], cwd=tmp_path,
                                env=runner.env(real_trainer=True, OUTPUT_DIR=str(out)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while (victim := child_of(proc.pid)) is None:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
    wait_then_kill(proc, victim, lambda: when(out))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
    if how == "run.sh":  # the wrapper passes the status on and says what survives
        assert proc.returncode == 137
        assert "run.sh: training was killed by signal 9 (exit 137)" in stderr
        assert f"run.sh: surviving valid checkpoints in {out}/checkpoints: checkpoint-2" in stderr

    # what a SIGKILL leaves: only complete checkpoints (a half-written one is a hidden temp dir)
    for c in list_checkpoints(out / "checkpoints"):
        assert is_valid_checkpoint(c) == (True, "ok"), c
    assert (trainer_state.find(out) is not None) == has_state

    # the same command again (run.sh's own exit-0 check is exercised by the run.sh trial), its `python -m opdkit`
    # commands in children of the warm runner (conftest): a plain rerun needs no fresh interpreter
    train_argv = ["train", "--out", str(out), "--quiet", *[x for a in KILL_ARGS for x in ("-S", a)]]
    if how == "run.sh":
        rerun = subprocess.run(["bash", str(REPO / "run.sh"), *KILL_ARGS], cwd=tmp_path,
                               env=runner.env(OUTPUT_DIR=str(out)), capture_output=True, text=True, timeout=300)
    else:
        rerun = subprocess.CompletedProcess(train_argv, *runner.run(train_argv, tmp_path / "rerun", cwd=tmp_path,
                                                                    timeout=300))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert ("resuming from" in rerun.stdout) == has_state
    assert [r["step"] for r in metric_rows(out)] == [1, 2, 3, 4, 5, 6]  # continued, no repeats, no gaps
    ckpts = list_checkpoints(out / "checkpoints")
    assert [c.name for c in ckpts] == ["checkpoint-4", "checkpoint-6"]  # publish.keep=2
    assert all(is_valid_checkpoint(c) == (True, "ok") for c in ckpts)
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert_same_weights(out / "checkpoints" / "checkpoint-6", kill_reference / "checkpoints" / "checkpoint-6")


# --- the state's cadence apart from the export's: checkpoints newer than the newest state ------------------------


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory) -> Path:
    """8 steps in one go, a checkpoint every 2: the reference for the replays below."""
    out = tmp_path_factory.mktemp("eight") / "out"
    result, _ = quiet_train(cfg("budget.max_steps=8", "publish.every_steps=2"), out)
    assert result.step == 8
    return out


def test_a_start_behind_a_newer_checkpoint_replays_the_steps_without_exporting_them(tmp_path, eight_steps):
    out = tmp_path / "out"
    # a state every 4 steps, a checkpoint every 2; the run killed after checkpoint-6 was published but before its
    # state: the newest state is step 4's
    run = ("budget.schedule_steps=8", "publish.every_steps=2", "publish.state_every_steps=4", "publish.keep_states=2")
    first, _ = quiet_train(cfg("budget.max_steps=6", *run), out)
    assert first.step == 6 and [p.name for p in (out / "state").iterdir()] == ["trainer_state-4", "trainer_state-6"]
    shutil.rmtree(out / "state" / "trainer_state-6")
    result, logs = quiet_train(cfg("budget.max_steps=8", *run), out)
    assert "resuming from" in logs and "trainer_state-4" in logs
    assert "checkpoint-6 is newer than the trainer state this start resumes from (step 4): steps 5..6 are trained " \
           "again and not exported" in logs
    assert "replacing existing" not in logs and logs.count("published ") == 1  # checkpoint-8 only
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert (result.step, result.final_checkpoint) == (8, "checkpoint-8")
    assert_same_weights(out / "checkpoints" / "checkpoint-8", eight_steps / "checkpoints" / "checkpoint-8")
    assert [r["step"] for r in metric_rows(out)] == list(range(1, 9))


def test_with_the_state_only_at_the_end_a_run_killed_before_it_starts_again_and_keeps_its_checkpoints(tmp_path,
                                                                                                      eight_steps):
    out = tmp_path / "out"
    run = ("budget.schedule_steps=8", "publish.every_steps=2", "publish.state_every_steps=0")
    first, logs = quiet_train(cfg("budget.max_steps=4", *run), out)
    assert logs.count("saved the trainer state") == 1  # at the end only
    shutil.rmtree(out / "state")  # killed before that one state was written
    result, logs = quiet_train(cfg("budget.max_steps=8", *run), out)
    assert "resuming from" not in logs and "checkpoint-4 is newer than the trainer state" in logs
    assert logs.count("published ") == 2 and "replacing existing" not in logs  # checkpoint-6 and -8
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert_same_weights(out / "checkpoints" / "checkpoint-8", eight_steps / "checkpoints" / "checkpoint-8")
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["run_id"] and run_json["final_checkpoint"] == "checkpoint-8"
    meta = json.loads((out / "checkpoints" / "checkpoint-8" / "opdkit.json").read_text())
    assert meta["run_id"] == run_json["run_id"]


def test_a_start_whose_budget_is_spent_behind_a_newer_checkpoint_ends_at_once_naming_that_checkpoint(tmp_path):
    out = tmp_path / "out"
    run = ("publish.every_steps=2", "publish.state_every_steps=4", "publish.keep_states=2", "optim.schedule=constant")
    quiet_train(cfg("budget.max_steps=6", *run), out)
    shutil.rmtree(out / "state" / "trainer_state-6")
    # the time the lost steps took is spent: this start stops before any step and publishes nothing older
    result, logs = quiet_train(cfg("budget.max_steps=6", "budget.max_wall_time_s=1", "budget.deadline_reserve_s=0.99",
                                   *run), out)
    # run.json's step is the run's end, as its final checkpoint and metrics rows say (it gave the lost state's 4)
    assert (result.reason, result.step, result.final_checkpoint) == ("wall_clock", 6, "checkpoint-6")
    assert "published " not in logs and [c.name for c in list_checkpoints(out / "checkpoints")][-1] == "checkpoint-6"
    assert [r["step"] for r in metric_rows(out)] == list(range(1, 7))  # steps 5-6 were not trained again: kept


def test_a_finished_run_whose_states_were_deleted_keeps_its_metrics_when_its_budget_is_spent(tmp_path):
    """A run's trainer states deleted after it ended (they are for resuming, and several times the model's size),
    then the same command again: with its wall budget spent no step fits, and the start took step 0 for a fresh
    run, dropped every train.jsonl row (the DVCLive log with them), saved a trainer state at step 0 and recorded a
    run completed at step 0. Now it ends at once, naming its newest checkpoint; the rows and the directory stay."""
    out = tmp_path / "out"
    run = ("budget.max_steps=6", "publish.every_steps=2", "optim.schedule=constant")
    quiet_train(cfg(*run), out)
    shutil.rmtree(out / "state")
    rows, tracked = metric_rows(out), snapshot(out / "dvclive")
    result, logs = quiet_train(cfg(*run, "budget.max_wall_time_s=1", "budget.deadline_reserve_s=0.99"), out)
    assert (result.reason, result.step, result.final_checkpoint) == ("wall_clock", 6, "checkpoint-6")  # step was 0
    assert json.loads((out / "run.json").read_text())["step"] == 6
    assert "checkpoint-6 is published: nothing to do" in logs and "published " not in logs.replace("is published", "")
    assert metric_rows(out) == rows and snapshot(out / "dvclive") == tracked
    assert not (out / "state").exists() or not list((out / "state").iterdir())  # no state of step 0
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]

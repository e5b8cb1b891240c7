"""The exit-status contract, with real processes: bad inputs fail before any training with one
line and leave OUTPUT_DIR as it was (exit 2); publish failures (injected into a real trainer
process by patching ``publish._write_safetensors``) are retried when transient and give a
non-zero exit naming the surviving checkpoints when they persist; ``validate`` rejects a stub.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from opdkit.embedded import asset
from opdkit.persist.checkpoints import is_valid_checkpoint
from opdkit.persist.fsutil import list_checkpoints
from procs import env

REPO = Path(__file__).resolve().parents[1]
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "runtime.threads=1", "optim.schedule=constant", "budget.max_wall_time_s=0"]


def snapshot(root: Path) -> dict | None:
    """Every path under ``root`` with its bytes and mtime (None if ``root`` does not exist)."""
    if not root.exists():
        return None
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))} | {".": root.stat().st_mtime_ns}


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad_inputs")
    (d / "no_weights").mkdir()
    (d / "no_weights" / "config.json").write_text((asset("student") / "config.json").read_text())
    (d / "table.csv").write_text("prompt,answer\n1+1,2\n")
    (d / "garbage.parquet").write_bytes(b"this is not parquet\n")
    (d / "no_prompt.jsonl").write_text(json.dumps({"query": "1+1", "answer": "2"}) + "\n")
    (d / "empty.jsonl").write_text("")
    rows = [{"prompt": "Compute 1+1.", "answer": "2"}, {"prompt": "", "answer": "3"}]
    (d / "empty_prompt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("truncated", "no_tokenizer", "nan_weights"):
        shutil.copytree(asset("student"), d / name)
    _plant_nan(d / "nan_weights" / "model.safetensors", "model.layers.1.mlp.up_proj.weight")
    weights = (d / "truncated" / "model.safetensors").read_bytes()
    (d / "truncated" / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # pruned: its header intact
    for f in (d / "no_tokenizer").glob("tokenizer*"):
        f.unlink()
    return d


def _plant_nan(weights: Path, name: str) -> None:
    """One NaN in tensor ``name`` of a safetensors file: the file stays whole (its header and sizes agree)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    tensors[name].view(-1)[7] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})


# (env, trailing args, what the one line must name)
BAD_INPUTS = {
    "model dir without weights": ({"STUDENT_MODEL": "{bad}/no_weights"}, [], "has no weights"),
    "truncated weights": ({"TEACHER_MODEL": "{bad}/truncated"}, [], "its weights are damaged: model.safetensors is "),
    "missing model path": ({"TEACHER_MODEL": "{bad}/nowhere"}, [], "does not exist"),
    "missing data path": ({"TRAIN_DATA": "{bad}/nowhere.parquet"}, [], "does not exist"),
    "data not parquet/jsonl": ({"TRAIN_DATA": "{bad}/table.csv"}, [], "table.csv: expected a .parquet"),
    "corrupt parquet": ({"TRAIN_DATA": "{bad}/garbage.parquet"}, [], "not a readable parquet"),
    "jsonl without needed columns": ({"TRAIN_DATA": "{bad}/no_prompt.jsonl"}, [], "expected a 'prompt' column"),
    "data with no rows": ({"TRAIN_DATA": "{bad}/empty.jsonl"}, [], "has no rows"),
    "a row with an empty prompt": ({"TRAIN_DATA": "{bad}/empty_prompt.jsonl"}, [], "row 1 (id 1): 'prompt' is empty"),
    "unknown override key": ({}, ["budget.max_stepz=3"], "unknown params key 'budget.max_stepz'"),
    "override of the wrong type": ({}, ["budget.max_steps=many"], "'budget.max_steps': expected int"),
    "override out of range": ({}, ["rollout.temperature=-1"], "'rollout.temperature': expected >= 0"),
    "env of the wrong type": ({"MAX_WALL_TIME_SECONDS": "soon"}, [], "'budget.max_wall_time_s': expected float"),
    "missing params file": ({"PARAMS": "{bad}/nowhere.yaml"}, [], "does not exist"),
    "state dir is a file": ({"CKPT_DIR": "{bad}/table.csv"}, [], "table.csv (runtime.state_dir) exists and is not a"),
}


EXISTING_DIR_CASES = ("model dir without weights", "truncated weights", "corrupt parquet", "unknown override key")
CASES = [(case, False) for case in BAD_INPUTS] + [(case, True) for case in EXISTING_DIR_CASES]


@pytest.fixture(scope="module")
def bad_input_runs(bad, tmp_path_factory, runner) -> dict:
    """run.sh once per case, three at a time, its ``python -m opdkit`` a child of the warm ``runner`` (conftest;
    a fresh interpreter would spend seconds importing torch for each case).
    With ``existing``, OUTPUT_DIR holds what an earlier run leaves behind, the lock file included."""
    def one(case: str, existing: bool):
        env_vars, args, _ = BAD_INPUTS[case]
        cwd = tmp_path_factory.mktemp("bad_input_run")
        out = cwd / "out"
        if existing:
            (out / "metrics").mkdir(parents=True)
            (out / "metrics" / "train.jsonl").write_text('{"step": 1}\n')
            (out / "config.yaml").write_text("seed: 0\n")
            (out / ".opdkit.lock").write_text("")
        before = snapshot(out)
        proc = subprocess.run(["bash", str(REPO / "run.sh"), "budget.max_steps=2", *args], cwd=cwd, text=True,
                              capture_output=True, timeout=180,
                              env=runner.env(OUTPUT_DIR=str(out),
                                             **{k: v.format(bad=bad) for k, v in env_vars.items()}))
        return proc, before, snapshot(out)

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {key: pool.submit(one, *key) for key in CASES}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("case,existing", CASES, ids=[f"{c}-{'existing' if e else 'fresh'}-dir" for c, e in CASES])
def test_bad_input_fails_with_one_line_and_leaves_output_dir_as_it_was(bad_input_runs, case, existing):
    proc, before, after = bad_input_runs[case, existing]
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("opdkit: error: "), proc.stderr
    assert BAD_INPUTS[case][2] in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "resolved config" not in proc.stdout  # nothing started
    assert after == before  # absent stays absent; existing is unchanged, byte for byte and mtime
    assert (before is None) != existing


NAN_NEEDLE = "its weights hold NaN or infinite values (first: model.layers.1.mlp.up_proj.weight)"


@pytest.mark.parametrize("model, needle", [("truncated", "its weights are damaged: model.safetensors is "),
                                           ("no_tokenizer", "its tokenizer cannot be loaded"),
                                           ("nan_weights", NAN_NEEDLE)])
def test_eval_refuses_a_damaged_model_directory_in_one_line(bad, tmp_path, capsys, model, needle):
    """``opdkit eval`` gave a raw traceback (exit 1) for these, after loading the weights; now one line, exit 2,
    nothing written."""
    from opdkit.cli import main

    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(bad / model), "--out", str(out), "-p", "none", "--quiet",
               "-S", "eval.max_questions=2"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("Loading weights")]  # (its bar: \r)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"opdkit: error: model directory {bad / model}: "), err
    assert needle in lines[0] and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_training_refuses_a_student_or_teacher_with_non_finite_weights_in_one_line(bad, tmp_path, capsys):
    """A NaN in the student's weights stopped training on its first batch with an alignment error that blamed
    padding or positions (a traceback, exit 1); in the teacher's, the first step's loss went non-finite (exit 3).
    Now the model that holds it is named, with the tensor, in one line (exit 2), before any step."""
    from opdkit.cli import main

    for role in ("student", "teacher"):
        out = tmp_path / role
        rc = main(["train", "--out", str(out), "-p", "none", "--quiet", "-S", f"{role}.path={bad / 'nan_weights'}",
                   *[x for o in [*TINY, "budget.max_steps=1"] for x in ("-S", o)]])
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("Loading weights")]
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith(f"opdkit: error: {role} model directory {bad / 'nan_weights'}: "), err
        assert NAN_NEEDLE in err[0]
        assert not list_checkpoints(out / "checkpoints")


@pytest.fixture
def read_only(tmp_path):
    """A directory this process cannot write: its permissions, or (as root, whom they do not stop) a read-only bind
    mount of it (skipped where mounting is not allowed)."""
    import os

    d = tmp_path / "read_only"
    d.mkdir()
    (d / "kept.txt").write_text("kept\n")
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    proc = subprocess.run(["mount", "--bind", str(d), str(d)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({(proc.stderr or proc.stdout).strip()})")
    try:
        proc = subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot remount read-only here ({(proc.stderr or proc.stdout).strip()})")
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _one_error_line(capsys) -> list[str]:
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "resolved config" not in out  # nothing started
    return err.splitlines()


@pytest.mark.parametrize("where", ["read-only", "under a file"])
def test_train_refuses_an_output_dir_it_cannot_write_in_one_line(read_only, tmp_path, capsys, where):
    """A read-only output directory (or one whose path runs through a file) ended in an OSError traceback (exit 1)
    from the lock file or the mkdir, after the checks and the models had loaded; now one line, exit 2, before."""
    from opdkit.cli import main

    base = read_only if where == "read-only" else tmp_path / "a_file"
    if where == "under a file":
        base.touch()
    for out in (base, base / "run"):
        if where == "under a file" and out == base:
            continue  # an output path that is a file: refused before (test_bad_input ...)
        rc = main(["train", "--out", str(out), "-p", "none", "--quiet", "-S", "budget.max_steps=1"])
        lines = _one_error_line(capsys)
        expected = "is on a read-only file system" if where == "read-only" else f"{base} is not a directory"
        assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"opdkit: error: output directory {out} cannot be "
                                                                   "written: "), lines
        assert expected in lines[0] or "is not writable" in lines[0], lines
    if where == "read-only":
        assert sorted(p.name for p in read_only.iterdir()) == ["kept.txt"]


@pytest.mark.parametrize("where", ["read-only", "under a file"])
def test_eval_refuses_an_out_it_cannot_write_before_evaluating(read_only, tmp_path, capsys, where):
    """``opdkit eval --out`` in a read-only directory evaluated every question (hours, on a real benchmark) and then
    ended in an OSError traceback (exit 1); now one line, exit 2, before the model is loaded."""
    from opdkit.cli import main

    base = read_only if where == "read-only" else tmp_path / "a_file"
    if where == "under a file":
        base.touch()
    out = base / "eval.json"
    rc = main(["eval", "--model", str(asset("student")), "--out", str(out), "-p", "none", "--quiet",
               "-S", "eval.max_questions=2"])
    lines = _one_error_line(capsys)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"opdkit: error: --out {out}: "), lines
    assert "cannot be written" in lines[0] and not any(ln.startswith("Loading weights") for ln in lines)


@pytest.mark.parametrize("argv", [
    ["embedded", "--out", "{out}"], ["fixture", "qwen2", "--out", "{out}"], ["study", "padding", "--out", "{out}"],
    ["vocab-cut", "--model", "{model}", "--out", "{out}"], ["report", "{model}", "--out", "{out}"],
    ["offline-rollouts", "--out", "{out}"],
], ids=lambda a: a[0])
def test_every_command_with_an_out_refuses_one_it_cannot_write_in_one_line(read_only, capsys, argv):
    """``opdkit embedded``, ``fixture``, ``study``, ``vocab-cut``, ``report --out`` and ``offline-rollouts`` with an
    ``--out`` in a read-only directory ended in an OSError traceback (exit 1) at their first write, the study after its
    runs; now one line naming --out, exit 2, before any work, and nothing there changes."""
    from opdkit.cli import main

    out = read_only / "made"
    args = [a.format(out=out, model=asset("student")) for a in argv]
    rc = main([*args, "-p", "none"] if args[0] in ("study", "offline-rollouts") else args)
    lines = _one_error_line(capsys)
    assert rc == 2 and lines and lines[-1].startswith(f"opdkit: error: --out {out}: "), lines
    assert "cannot be written" in lines[-1] and "read-only" in lines[-1], lines
    assert sorted(p.name for p in read_only.iterdir()) == ["kept.txt"]


def test_a_reader_that_stops_early_ends_the_command_without_a_traceback():
    """``opdkit report ... | head`` (a reader that closes the pipe before the command has written) printed a
    BrokenPipeError traceback and exited 1; now it ends quietly with 141, as a pipeline's command ended by SIGPIPE."""
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m opdkit repeats --sd 0.015 | true; "
                                         "echo status ${PIPESTATUS[0]} >&2"],
                          cwd=REPO, text=True, capture_output=True, timeout=120, env=env())
    assert proc.stderr.splitlines() == ["status 141"], proc.stderr


def test_training_goes_on_when_its_stdout_reader_stops_early(tmp_path):
    """``opdkit train ... | head -1`` failed the run at its next log line (BrokenPipeError, exit 1, run.json
    "failed"): a reader of the console lines that stops is not a reason to end a training run."""
    out = tmp_path / "out"
    tiny = " ".join(f"-S {o}" for o in TINY)
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m opdkit train --out {out} -p none --quiet {tiny} "
                                         "-S budget.max_steps=2 | head -1; echo status ${PIPESTATUS[0]} >&2"],
                          cwd=tmp_path, text=True, capture_output=True, timeout=300, env=env())
    lines = proc.stderr.splitlines()
    assert lines[-1] == "status 0", proc.stderr
    assert any(line.startswith("opdkit: stdout's reader stopped reading; training goes on") for line in lines)
    assert json.loads((out / "run.json").read_text())["status"] == "completed"
    assert len((out / "metrics" / "train.jsonl").read_text().splitlines()) == 2
    assert is_valid_checkpoint(out / "checkpoints" / "checkpoint-2")


@pytest.mark.parametrize("flags, reader", [("-p none --quiet", "head -1"), ("", "head -c 10")])
def test_training_goes_on_when_its_stdout_and_stderr_reader_stops_early(tmp_path, flags, reader):
    """``opdkit train ... 2>&1 | head -1``: the line saying that stdout's reader stopped went to the same closed pipe,
    and its BrokenPipeError failed the run (exit 141, run.json "failed"). Without --quiet, a reader gone before the
    models load failed it in transformers' "Loading weights" bar (run.json: ModelError ... Broken pipe)."""
    out = tmp_path / "out"
    tiny = " ".join(f"-S {o}" for o in TINY)
    proc = subprocess.run(["bash", "-c", f"{sys.executable} -m opdkit train --out {out} {flags} {tiny} "
                                         f"-S budget.max_steps=2 2>&1 | {reader}; echo status ${{PIPESTATUS[0]}} >&2"],
                          cwd=tmp_path, text=True, capture_output=True, timeout=300, env=env())
    assert proc.stderr.splitlines() == ["status 0"], proc.stderr
    assert len(proc.stdout.splitlines()) == 1, proc.stdout
    assert json.loads((out / "run.json").read_text())["status"] == "completed"
    assert len((out / "metrics" / "train.jsonl").read_text().splitlines()) == 2
    assert is_valid_checkpoint(out / "checkpoints" / "checkpoint-2")


def test_bad_nproc_is_refused_by_run_sh(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "run.sh")], cwd=tmp_path, text=True, capture_output=True, timeout=30,
                          env=env(OUTPUT_DIR=str(tmp_path / "out"), NPROC="two"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "NPROC" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_bad_params_key_fails_before_torch_is_imported(tmp_path):
    """A typo in -S is refused by the config alone: matching the error to its exit status imports nothing."""
    code = ("import sys; from opdkit.cli import main; "
            f"rc = main(['train', '--out', {str(tmp_path / 'out')!r}, '-S', 'budget.max_stepz=3']); "
            "print(rc, 'torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=60, env=env())
    assert proc.stderr.splitlines()[-1] == "2 False", proc.stderr
    assert "unknown params key 'budget.max_stepz'" in proc.stderr and not (tmp_path / "out").exists()


def test_the_exit_status_table_names_real_exception_classes():
    import importlib

    from opdkit import cli

    for module, name in cli._EXPECTED:
        assert issubclass(getattr(importlib.import_module(module), name), Exception), (module, name)
    importlib.import_module("opdkit.persist.publish")
    assert cli._publish_error() == (importlib.import_module("opdkit.persist.publish").PublishError,)


def test_validate_rejects_a_stub_with_the_reason(tmp_path, runner):
    stub = tmp_path / "checkpoint-7"
    stub.mkdir()
    (stub / "config.json").write_text((asset("student") / "config.json").read_text())
    (stub / "model.safetensors").write_bytes(b"\0" * 4)  # a weights file cut short
    good = asset("student")
    proc = subprocess.run([runner.python, "-m", "opdkit", "validate", str(good), str(stub)], text=True,
                          capture_output=True, timeout=120, env=runner.env())  # (a child of the warm runner)
    assert proc.returncode == 1  # run.sh's exit 0 path covers a valid one alone
    assert proc.stdout.splitlines() == [f"{good}: valid", f"{stub}: INVALID: model.safetensors is 4 bytes: "
                                        "not a safetensors file (truncated?)"]


# --- injected publish failures in a real trainer process ------------------------------------

INJECT = textwrap.dedent("""
    import errno
    import opdkit.persist.publish as p
    real, calls = p._write_safetensors, []
    def flaky(path, tensors):
        calls.append(path)
        if {fail}:
            raise OSError(errno.ECOMM, "Communication error on send", str(path))
        return real(path, tensors)
    p._write_safetensors = flaky
""")


def run_injected(runner, fail: str, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``opdkit train`` with the fault patched in before the command, in a child of the warm ``runner`` (conftest:
    a process of its own, spared a fresh interpreter's imports)."""
    args = ["train", "--out", str(out), "--quiet"] + [x for o in TINY + list(overrides) for x in ("-S", o)]
    logs = out.parent / f"logs_{len(list(out.parent.glob('logs_*')))}"
    status, stdout, stderr = runner.run(args, logs, cwd=out.parent, timeout=300, code=INJECT.format(fail=fail))
    return subprocess.CompletedProcess(args, status, stdout, stderr)


def test_transient_publish_error_is_retried_and_the_run_succeeds(tmp_path, runner):
    out = tmp_path / "out"
    proc = run_injected(runner, "len(calls) == 1", out, "budget.max_steps=1", "publish.backoff_s=0.01")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "transient I/O error" in proc.stdout and "Communication error on send" in proc.stdout
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["checkpoint-1"]
    assert is_valid_checkpoint(out / "checkpoints" / "checkpoint-1") == (True, "ok")
    assert json.loads((out / "run.json").read_text())["status"] == "completed"
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]


@pytest.mark.slow
def test_persistent_publish_error_fails_naming_survivors_then_a_rerun_recovers(tmp_path, runner):
    out = tmp_path / "out"
    steps = ["budget.max_steps=3", "publish.every_steps=1", "publish.retries=2", "publish.backoff_s=0.01"]
    proc = run_injected(runner, "len(calls) >= 2", out, *steps)  # checkpoint-1 is written, every later write fails
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "publishing checkpoint-2" in last and "gave up" in last
    assert "surviving valid checkpoints: checkpoint-1" in last
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["checkpoint-1"]
    assert is_valid_checkpoint(out / "checkpoints" / "checkpoint-1") == (True, "ok")
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert json.loads((out / "run.json").read_text())["status"] == "failed"

    # the file system is back: the same command resumes, publishes the missing step, finishes
    proc = run_injected(runner, "False", out, *steps)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stdout
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    steps_logged = [json.loads(ln)["step"] for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]
    assert steps_logged == [1, 2, 3]

"""Numerical and process faults never end in a silent success (issue 15), with real trainer
processes: non-finite values (the issue's lr=1e4 reproduction, and NaN gradients injected at
chosen steps), a NaN tensor at export and in ``opdkit validate``, stop signals, a full disk (a real
tmpfs where the machine lets us mount one) and a read-only file system, and CUDA out of memory
(injected on the CPU). Each asserts the exit status, run.json, and which checkpoints and trainer
state survive; the exports' dtype and sharding are checked against the safetensors reader and
``from_pretrained``.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from opdkit.embedded import asset
from opdkit.persist import trainer_state
from opdkit.persist.checkpoints import (
    InvalidCheckpoint,
    NonFiniteTensor,
    is_valid_checkpoint,
    validate_checkpoint,
)
from opdkit.persist.fsutil import list_checkpoints
from opdkit.persist.publish import export_checkpoint
from procs import env
from signal_harness import OpdkitRunner

REPO = Path(__file__).resolve().parents[1]
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "runtime.threads=1", "optim.schedule=constant", "budget.max_wall_time_s=0", "publish.backoff_s=0.01"]

# A real trainer process with one fault injected by patching a library function before main().
# {when}: a Python expression over n, the 1-based call count of the patched function.
INJECT = {
    "nan_grad": """
        import opdkit.step as o
        real = o.micro_losses
        def patched(cfg, student, *a, **k):
            m = real(cfg, student, *a, **k)
            if WHEN(count()):  # a NaN gradient, as a bad batch or an overflow gives
                next(p for p in student.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
            return m
        o.micro_losses = patched
    """,
    "oom_score": """
        import torch, opdkit.step as o
        real = o.score_batch
        def patched(*a, **k):
            if WHEN(count()):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return real(*a, **k)
        o.score_batch = patched
    """,
    "erofs_publish": """
        import errno, opdkit.persist.publish as p
        real = p._write_safetensors
        def patched(path, tensors):
            if WHEN(count()):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real(path, tensors)
        p._write_safetensors = patched
    """,
    "nan_export": """
        import opdkit.distributed as d
        real = d.gather_weights
        def patched(model, **kw):
            sd = real(model, **kw)
            if WHEN(count()):  # the weights handed to the exporter (the live model stays finite)
                sd["model.norm.weight"][3] = float("nan")
            return sd
        d.gather_weights = patched
    """,
    "none": "",
}
PRELUDE = """
import sys
calls = [0]
def count():
    calls[0] += 1
    return calls[0]
WHEN = lambda n: {when}
"""
MAIN = "\nfrom opdkit.cli import main\nraise SystemExit(main(sys.argv[1:]))\n"


def fault_code(fault: str = "none", when: str = "False") -> str:
    """The code that injects ``fault`` (INJECT) at the calls where ``when`` holds, run before the command."""
    return PRELUDE.format(when=when) + textwrap.dedent(INJECT[fault])


def train_argv(out: Path, overrides) -> list[str]:
    return ["train", "--out", str(out), "--quiet", "-p", "none", *[x for o in [*TINY, *overrides] for x in ("-S", o)]]


def train_cmd(out: Path, overrides, fault: str = "none", when: str = "False") -> list[str]:
    return [sys.executable, "-c", fault_code(fault, when) + MAIN, *train_argv(out, overrides)]


def run_train(runner: OpdkitRunner, out: Path, overrides, fault: str = "none",
              when: str = "False") -> subprocess.CompletedProcess:
    """``train_cmd``'s run (its fault injected in the child before the command), in a child of the warm ``runner``
    (conftest): these runs need no signal of their own, so each is spared a fresh interpreter's imports."""
    argv = train_argv(out, overrides)
    logs = out.parent / f"logs_{len(list(out.parent.glob('logs_*')))}"
    status, stdout, stderr = runner.run(argv, logs, cwd=out.parent, timeout=300, code=fault_code(fault, when))
    return subprocess.CompletedProcess(argv, status, stdout, stderr)


def opdkit_here(argv: list[str], capsys) -> tuple[int, str, str]:
    """``opdkit ARGV`` by the CLI's own entry point in this process (``python -m opdkit`` is
    ``raise SystemExit(main())``; a fresh interpreter would spend seconds importing torch for a check of a
    moment): its exit status, stdout and stderr."""
    from opdkit.cli import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    said = capsys.readouterr()
    return code, said.out, said.err


def run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def ckpt_names(out: Path) -> list[str]:
    return [c.name for c in list_checkpoints(out / "checkpoints")]


def rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]


def state_step(out: Path) -> int:
    return trainer_state.peek(out)["step"]


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt / "model.safetensors")


def no_temp_dirs(out: Path) -> bool:
    ckpts = out / "checkpoints"
    return not ckpts.exists() or not any(p.name.startswith(".tmp") for p in ckpts.iterdir())


# --- non-finite values ------------------------------------------------------------------------


def test_the_issue_reproduction_lr_1e4_stops_with_exit_3_at_the_first_non_finite_step(runner, tmp_path):
    """Issue 15: lr 1e4 without clipping made grad_norm NaN from step 2; the run published NaN
    weights, called them valid and exited 0. Now: exit 3 at the first non-finite step, nothing of it
    or after it published, the last good state kept.

    Which step first goes non-finite is not a property of the code: after step 1's 1e4-sized update
    the logits saturate (grad_norm 0.0 for a step or more) and where an inf/NaN first appears depends
    on the float kernels (the same commit stops at step 2 on one machine and at step 4 on an AVX-512
    one). So the step is read from the message and everything is checked against it."""
    out = tmp_path / "out"
    proc = run_train(runner, out, ["optim.lr=1e4", "optim.grad_clip=0", "optim.warmup_steps=0", "budget.max_steps=6",
                           "publish.every_steps=3"])
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    m = re.match(r"opdkit: training stopped: non-finite grad_norm at step (\d+) \(", last)
    assert m and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    bad = int(m.group(1))
    assert 2 <= bad <= 6  # step 1 trains the finite shipped weights; the reproduction must blow up within the run
    got = rows(out)
    assert [r["step"] for r in got] == list(range(1, bad))  # the non-finite step left no row and no update
    assert all(r["loss"] is not None and r["grad_norm"] is not None and r["grad_norm"] >= 0 for r in got)  # finite
    good = [f"checkpoint-{s}" for s in (3, 6) if s < bad]  # publish.every_steps=3: only those before the bad step
    run = run_json(out)
    assert (run["status"], run["step"], run["nonfinite"], run["checkpoints"]) == ("failed", bad, ["grad_norm"], good)
    assert ckpt_names(out) == good and no_temp_dirs(out)
    for name in good:  # what survives is finite and loads (validate reads every tensor's values)
        assert validate_checkpoint(out / "checkpoints" / name) is None
    if good:
        assert state_step(out) == 3 and f"trainer state {trainer_state.find(out)} is the last good one" in last
        assert "surviving valid checkpoints: checkpoint-3" in last
    else:
        assert trainer_state.find(out) is None
        assert "no trainer state was saved before" in last and "no valid checkpoint survives" in last


def test_a_nan_gradient_stops_before_the_update_and_a_rerun_resumes_from_the_last_good_state(runner, tmp_path):
    out = tmp_path / "out"
    args = ["budget.max_steps=6", "publish.every_steps=2"]
    proc = run_train(runner, out, args, "nan_grad", when="n == 3")  # the 3rd step's gradient
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "non-finite grad_norm at step 3" in proc.stderr
    assert f"trainer state {trainer_state.find(out)} is the last good one" in proc.stderr
    run = run_json(out)
    got = (run["status"], run["step"], run["nonfinite"], run["checkpoints"])
    assert got == ("failed", 3, ["grad_norm"], ["checkpoint-2"])
    assert state_step(out) == 2 and ckpt_names(out) == ["checkpoint-2"]
    assert validate_checkpoint(out / "checkpoints" / "checkpoint-2") is None

    again = run_train(runner, out, args)  # the fault is gone: the same command resumes at step 2 and finishes
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout and "step 2," in again.stdout
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5, 6]
    assert ckpt_names(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert run_json(out)["status"] == "completed"


def test_skip_drops_non_finite_updates_then_stops_after_too_many_in_a_row(runner, tmp_path):
    out = tmp_path / "out"
    proc = run_train(runner, out, ["budget.max_steps=8", "publish.every_steps=2", "runtime.on_nonfinite=skip",
                           "runtime.max_nonfinite_skips=2"], "nan_grad", when="n >= 3")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "non-finite grad_norm at step 5" in proc.stderr and "3 steps in a row" in proc.stderr
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r.get("skipped_nonfinite") for r in got] == [None, None, ["grad_norm"], ["grad_norm"]]
    assert got[2]["grad_norm"] is None  # strict JSON: NaN written as null, the row names it
    run = run_json(out)
    assert (run["status"], run["step"], run["nonfinite"]) == ("failed", 5, ["grad_norm"])
    # steps 3 and 4 were dropped: checkpoint-4 holds exactly the weights of checkpoint-2
    assert ckpt_names(out) == ["checkpoint-2", "checkpoint-4"] and state_step(out) == 4
    w2, w4 = weights(out / "checkpoints" / "checkpoint-2"), weights(out / "checkpoints" / "checkpoint-4")
    assert w2.keys() == w4.keys() and all(torch.equal(w2[k], w4[k]) for k in w2)
    w0 = load_file(asset("student") / "model.safetensors")
    assert any(not torch.equal(w0[k], w2[k]) for k in w2)  # steps 1-2 did update


# --- NaN in an export, and in a file given to validate ----------------------------------------


def _student_parts(nan_in: str | None = None) -> dict:
    from opdkit.models import load_model, load_tokenizer

    model = load_model(asset("student"), torch.device("cpu"))
    sd = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if nan_in:
        sd[nan_in].view(-1)[7] = float("nan")
    return dict(state_dict=sd, model_config=model.config, tokenizer=load_tokenizer(asset("student")),
                generation_config=model.generation_config)


def test_an_export_with_a_nan_tensor_is_never_written(tmp_path):
    with pytest.raises(NonFiniteTensor, match="tensor model.layers.1.mlp.up_proj.weight has NaN"):
        export_checkpoint(tmp_path / "ckpts", 5, **_student_parts("model.layers.1.mlp.up_proj.weight"), meta={},
                          keep=2, retries=0, backoff_s=0, log=lambda s: None)
    assert not (tmp_path / "ckpts").exists() or list((tmp_path / "ckpts").iterdir()) == []
    # float16 overflows where float32 does not: checked after the cast
    parts = _student_parts()
    parts["state_dict"]["model.norm.weight"][0] = 1e6
    with pytest.raises(NonFiniteTensor, match="model.norm.weight .*float16"):
        export_checkpoint(tmp_path / "ckpts", 5, **parts, meta={}, keep=2, retries=0, backoff_s=0,
                          dtype=torch.float16, log=lambda s: None)


def test_a_trainer_whose_export_holds_a_nan_stops_with_exit_3_and_publishes_nothing_of_it(runner, tmp_path):
    out = tmp_path / "out"
    proc = run_train(runner, out, ["budget.max_steps=4", "publish.every_steps=2"], "nan_export", when="n == 2")
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "publishing checkpoint-4" in last and "tensor model.norm.weight has NaN or infinite values" in last
    assert "surviving valid checkpoints: checkpoint-2" in last
    assert ckpt_names(out) == ["checkpoint-2"] and no_temp_dirs(out) and run_json(out)["status"] == "failed"


def test_validate_streams_the_weights_and_rejects_a_nan_naming_the_tensor(tmp_path, capsys):
    path = shutil.copytree(asset("student"), tmp_path / "bad")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"].view(-1)[-1] = float("inf")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})  # the reference writer
    validate_checkpoint(path, full=False)  # the headers are sound ...
    with pytest.raises(InvalidCheckpoint, match="tensor model.layers.0.self_attn.k_proj.weight in model.safetensors "
                                                "has NaN or infinite values"):
        validate_checkpoint(path)  # ... the values are not
    code, stdout, _ = opdkit_here(["validate", str(path)], capsys)
    assert code == 1 and "INVALID: tensor model.layers.0.self_attn.k_proj.weight" in stdout


# --- dtype and shards -------------------------------------------------------------------------


def test_exports_are_in_the_requested_dtype_and_sharded_with_an_index(tmp_path):
    parts = _student_parts()
    ref = {k: v.to(torch.bfloat16) for k, v in parts["state_dict"].items()}  # torch's own cast
    path = export_checkpoint(tmp_path, 3, **parts, meta={}, keep=1, retries=0, backoff_s=0, dtype=torch.bfloat16,
                             max_shard_size="300KB", log=lambda s: None)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (path / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"  # save_pretrained's names
    stored = {}
    for shard in shards:
        got = load_file(path / shard)  # the reference reader
        assert all(index["weight_map"][k] == shard for k in got)
        assert sum(t.numel() * 2 for t in got.values()) <= 300_000 or len(got) == 1
        stored.update(got)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in stored.values())
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    validate_checkpoint(path)  # streams every shard, loads through the index
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    # a shard that holds a tensor the index maps elsewhere is rejected
    moved = next(k for k, f in index["weight_map"].items() if f == shards[1])
    index["weight_map"][moved] = shards[0]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "opdkit.json").unlink()
    with pytest.raises(InvalidCheckpoint, match=f"{shards[1]} holds tensor {moved}, which .* maps to {shards[0]}"):
        validate_checkpoint(path, full=False)


# --- stop signals -----------------------------------------------------------------------------


def wait_for_rows(proc: subprocess.Popen, out: Path, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ((out / "metrics" / "train.jsonl").exists() and len(rows_or_empty(out)) >= n):
        assert proc.poll() is None, f"the trainer ended (exit {proc.returncode}) before step {n}"
        assert time.monotonic() < deadline, f"the trainer did not reach step {n}"
        time.sleep(0.05)


def rows_or_empty(out: Path) -> list[str]:
    return [ln for ln in (out / "metrics" / "train.jsonl").read_text().splitlines() if ln.endswith("}")]


def test_a_stop_signal_sets_a_flag_a_repeat_is_the_same_stop_and_a_later_one_stops_at_once():
    code = textwrap.dedent("""
        import os, signal, time
        from opdkit import interrupt
        interrupt.REPEAT_WINDOW_S = 1.0
        with interrupt.stop_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)  # no exception: the loop reads the flag
            print("flag", interrupt.requested(), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)  # the same stop again (the process group, then a relaying parent)
            os.kill(os.getpid(), signal.SIGINT)
            print("still running", flush=True)
            time.sleep(1.5)
            os.kill(os.getpid(), signal.SIGINT)  # a second request, after the window: the default action, at once
            time.sleep(30)
            print("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=60, env=env())
    assert proc.stdout == f"flag {int(signal.SIGTERM)}\nstill running\n" and proc.returncode == -signal.SIGINT
    assert proc.stderr.count("received: stopping") == 1 and "SIGTERM received: stopping" in proc.stderr


@pytest.mark.slow
def test_sigint_finishes_the_step_saves_state_and_a_sharded_bf16_checkpoint_and_exits_130(tmp_path):
    out = tmp_path / "out"
    args = ["budget.max_steps=400", "publish.every_steps=1000", "publish.dtype=bfloat16",
            "publish.max_shard_size=300KB"]
    proc = subprocess.Popen(train_cmd(out, args), cwd=tmp_path, env=env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_rows(proc, out, 2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "SIGINT received: stopping" in stderr and "Traceback" not in stderr
    steps = [r["step"] for r in rows(out)]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 400
    run = run_json(out)
    assert (run["status"], run["reason"], run["step"]) == ("stopped", "SIGINT", last)
    want = f"opdkit: training stopped by SIGINT at step {last}; surviving valid checkpoints: checkpoint-{last}"
    assert want in stderr
    # the step in flight finished, and its state and checkpoint are there (sharded, bf16, valid)
    assert state_step(out) == last and ckpt_names(out) == [f"checkpoint-{last}"] and no_temp_dirs(out)
    ckpt = out / "checkpoints" / f"checkpoint-{last}"
    assert is_valid_checkpoint(ckpt) == (True, "ok") and (ckpt / "model.safetensors.index.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(ckpt).dtype == torch.bfloat16


# --- full and read-only file systems ----------------------------------------------------------


def _weights_bytes() -> int:
    """The shipped student's fp32 weights file: what one export of it needs."""
    return (asset("student") / "model.safetensors").stat().st_size


def _kib(n: float) -> str:
    return f"{int(n // 1024)}k"


@pytest.fixture
def tmpfs(tmp_path):
    """mount(dir, size) -> a real tmpfs of that size at dir (skipped where mounting is not allowed)."""
    mounted: list[Path] = []

    def mount(where: Path, size: str) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({(proc.stderr or proc.stdout).strip() or proc.returncode})")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_checkpoint_disk_fails_at_once_naming_the_space_and_keeps_the_previous_checkpoint(runner, tmp_path,
                                                                                                 tmpfs):
    out = tmp_path / "out"
    tmpfs(out / "checkpoints", _kib(1.75 * _weights_bytes()))  # one fp32 export fits, a second beside it does not
    proc = run_train(runner, out, ["budget.max_steps=4", "publish.every_steps=2"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    m = re.search(r"publishing checkpoint-4 to .* no space left on the device for (\S+): checkpoint-4 needs about "
                  r"([\d.]+) MiB, ([\d.]+) MiB free there", last)
    assert m and m[1] == str(out / "checkpoints"), last
    weights_mib = (out / "checkpoints" / "checkpoint-2" / "model.safetensors").stat().st_size / 2**20
    assert float(m[2]) >= weights_mib and float(m[3]) < weights_mib  # what it needs vs what df would say is free
    assert "surviving valid checkpoints: checkpoint-2" in last
    assert "transient" not in proc.stdout and "Traceback" not in proc.stderr  # not retried
    assert ckpt_names(out) == ["checkpoint-2"] and is_valid_checkpoint(out / "checkpoints" / "checkpoint-2")[0]
    assert no_temp_dirs(out) and state_step(out) == 4  # the state is saved before its checkpoint
    assert run_json(out)["status"] == "failed"


def test_a_full_state_disk_keeps_the_previous_state_and_checkpoint(runner, tmp_path, tmpfs):
    out = tmp_path / "out"
    tmpfs(out / "state", _kib(4.8 * _weights_bytes()))  # one state (~3x the weights: + Adam's two moments) fits;
    # its replacement beside it does not
    proc = run_train(runner, out, ["budget.max_steps=4", "publish.every_steps=2"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    m = re.match(rf"opdkit: training failed: \[Errno {errno.ENOSPC}\] no space left on the device for (\S+): "
                 r"the trainer state at step 4 needs about ([\d.]+) MiB, ([\d.]+) MiB free there", last)
    assert m and m[1] == str(out / "state"), last
    kept = trainer_state.find(out)  # the step-2 state: the step-4 one is as large
    state_mib = sum(f.stat().st_size for f in kept.iterdir()) / 2**20
    assert abs(float(m[2]) - state_mib) < 0.05 * state_mib and float(m[3]) < state_mib
    assert "surviving valid checkpoints: checkpoint-2" in last and "Traceback" not in proc.stderr
    assert state_step(out) == 2 and sorted(p.name for p in (out / "state").iterdir()) == ["trainer_state-2"]
    assert ckpt_names(out) == ["checkpoint-2"]


def test_a_read_only_file_system_is_not_retried_and_says_so(runner, tmp_path):
    out = tmp_path / "out"
    proc = run_train(runner, out, ["budget.max_steps=4", "publish.every_steps=2"], "erofs_publish", when="n >= 2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert f"{out / 'checkpoints'} is on a read-only file system: checkpoint-4 needs" in last
    assert "surviving valid checkpoints: checkpoint-2" in last and "transient" not in proc.stdout
    assert ckpt_names(out) == ["checkpoint-2"] and no_temp_dirs(out)


# --- out of memory ----------------------------------------------------------------------------


def test_out_of_memory_names_the_phase_and_the_knobs_and_keeps_the_state(runner, tmp_path):
    out = tmp_path / "out"
    proc = run_train(runner, out, ["budget.max_steps=4", "publish.every_steps=2"], "oom_score", when="n == 3")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("opdkit: training failed: out of memory in the score phase of step 3 "
                           "(CUDA out of memory. Tried to allocate 20.00 GiB)")
    for knob in ("runtime.logprob_chunk", "optim.micro_batch"):
        assert knob in last
    assert "surviving valid checkpoints: checkpoint-2" in last and "Traceback" not in proc.stderr
    run = run_json(out)
    assert (run["status"], run["step"], run["out_of_memory"]) == ("failed", 3, "score")
    assert state_step(out) == 2 and ckpt_names(out) == ["checkpoint-2"]


# --- bad input stays bad input; run.sh under torchrun -----------------------------------------


def test_a_bad_shard_size_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    # (a bad runtime.on_nonfinite / publish.dtype is refused by the config's choices, as every choice key)
    override, message = "publish.max_shard_size=lots", ("opdkit: error: publish.max_shard_size: expected a size "
                                                         "such as 5GB or 500MB, got 'lots'")
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    code, _, stderr = opdkit_here(["train", "--out", str(out), "-p", "none", "-S", override], capsys)
    assert code == 2 and len(stderr.splitlines()) == 1 and stderr.startswith(message), stderr
    assert not out.exists()


def test_run_sh_recovers_the_status_torchrun_flattens_from_run_json(tmp_path, runner):
    record, expected = {"status": "failed", "nonfinite": ["loss"], "step": 3}, 3  # (a "stopped" record: 128+N)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = tmp_path / "out"
    fake = bin_dir / "torchrun"  # a worker wrote run.json, then torchrun exited 1 as it does for any failure
    fake.write_text(f"#!/usr/bin/env bash\nmkdir -p {out}\necho '{json.dumps(record)}' > {out}/run.json\nexit 1\n")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "run.sh"), "budget.max_steps=2"], cwd=tmp_path, text=True,
                          capture_output=True, timeout=120,
                          env=runner.env(OUTPUT_DIR=str(out), NPROC="2", PATH=f"{bin_dir}:{env()['PATH']}"))
    # (its `python -m opdkit train --check`: a child of the warm runner)
    assert proc.returncode == expected, proc.stderr

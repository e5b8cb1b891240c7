"""Faults of torchrun runs (2 gloo processes, real ``opdkit train`` runs): a stuck rank ends the
run at ``runtime.collective_timeout_s``, naming the phase; a stop signal to the launcher stops every
rank; SIGKILL of every rank in the middle of writing the trainer state leaves only complete states,
and the rerun ends with the uninterrupted run's weights, bit for bit.

Faults are planted from outside the library: a ``sitecustomize`` on the workers' path patches a
function in one rank. The stall makes rank 1, at its first ``micro_losses``, wait for a message no
rank sends (``dist.recv``), so it never joins the step's collectives while rank 0 waits in them;
both are blocked inside gloo, where no Python signal handler runs.
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
import torch

from opdkit.persist import trainer_state
from opdkit.persist.fsutil import list_checkpoints
from procs import env
from signal_harness import REPO, alive, descendants, still_alive, wait_for, write_sitecustomize

TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "runtime.threads=1", "optim.schedule=constant", "budget.max_wall_time_s=0"]
FAULTS = {
    "stall": """
        import torch
        import torch.distributed as dist
        import opdkit.step as o

        real = o.micro_losses

        def stalled(*a, **k):  # never joins the step's collectives: waits for a message nobody sends
            print(f"rank {os.environ['RANK']} stalls", flush=True)
            dist.recv(torch.zeros(1), src=0)
            return real(*a, **k)

        o.micro_losses = stalled
    """,
    "slow_state": """
        import time
        import opdkit.persist.tensor_files as tf

        real = tf._pwrite_all

        def slow(*a, **k):  # each tensor of the trainer state takes a while: a wide window to kill in
            time.sleep(0.05)
            return real(*a, **k)

        tf._pwrite_all = slow
    """,
}


def fault_env(tmp_path: Path, fault: str, rank: int = 1, **extra) -> dict:
    code = "import os\nif os.environ.get('RANK') == os.environ.get('OPDKIT_TEST_FAULT_RANK'):\n"
    site = write_sitecustomize(tmp_path / "fault_site", code + textwrap.indent(textwrap.dedent(FAULTS[fault]), "    "))
    return env(PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), OPDKIT_TEST_FAULT_RANK=str(rank), **extra)


def torchrun_cmd(out: Path, *overrides: str, python: Path | None = None) -> list[str]:
    """torchrun, 2 ranks of ``python -m opdkit train``; ``python``: the warm runner's (conftest), for the runs that
    nothing signals nor plants a fault in (``--no-python``: each rank is ``PYTHON -m opdkit train ...``, its command
    in a child of the runner with the rank's environment: spared a fresh interpreter's imports per rank)."""
    ranks = ["--no-python", str(python)] if python else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *ranks, "-m",
            "opdkit", "train", "--out", str(out), "-p", "none", "--quiet",
            *[x for o in [*TINY, *overrides] for x in ("-S", o)]]


def two_workers(proc: subprocess.Popen) -> set[int]:
    """The two trainer processes under ``proc`` (python processes running ``opdkit train``)."""
    found: set[int] = set()

    def ready() -> bool:
        found.clear()
        for p in descendants(proc.pid):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"opdkit" in cmd and b"train" in cmd and b"torch.distributed.run" not in cmd and \
                    not any(c.endswith(b"torchrun") for c in cmd[:2]):
                found.add(p)
        return len(found) == 2

    wait_for(ready, proc, 60, "the two workers")
    return set(found)


@pytest.mark.slow
def test_a_rank_that_never_joins_ends_the_run_at_the_collective_timeout_naming_the_phase(tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = subprocess.run(torchrun_cmd(out, "budget.max_steps=2", "runtime.collective_timeout_s=5"), cwd=tmp_path,
                       env=fault_env(tmp_path, "stall"), capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t0
    assert r.returncode != 0 and "rank 1 stalls" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert "a collective did not complete in the update phase of step 1" in r.stderr
    assert "runtime.collective_timeout_s=5 bounds the wait" in r.stderr
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["step"], run["collective_failure"]) == ("failed", 1, "update")
    # nothing of the stuck step saved
    assert list_checkpoints(out / "checkpoints") == [] and trainer_state.peek(out) is None
    print(f"stuck rank: the run ended after {took:.0f}s (5 s timeout)")


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_of_a_stuck_run(tmp_path):
    """Both ranks are blocked in gloo (no Python handler runs there): torchrun passes the signal
    on, then kills them after its grace (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), well before the long
    collective timeout."""
    out = tmp_path / "out"
    proc = subprocess.Popen(torchrun_cmd(out, "budget.max_steps=2", "runtime.collective_timeout_s=600"),
                            cwd=tmp_path, env=fault_env(tmp_path, "stall", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        workers = two_workers(proc)
        wait_for(lambda: (out / "metrics").is_dir(), proc, 180, "the first step")
        time.sleep(3)  # rank 1 is in its stall, rank 0 in the step's first collective
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    left = still_alive(workers)
    assert not left, f"ranks left running after torchrun ended: {left}"
    assert proc.returncode != 0
    print(f"SIGTERM to torchrun: every rank gone after {took:.1f}s")


@pytest.mark.slow
def test_sigterm_to_run_sh_with_two_ranks_stops_them_after_the_step_with_their_state(tmp_path, runner):
    out = tmp_path / "out"
    # (torchrun starts the ranks as always; run.sh's preflight and its validation of the survivors run in children of
    # the warm runner, each spared a fresh interpreter's imports)
    proc = subprocess.Popen(["bash", str(REPO / "run.sh"), *TINY, "budget.max_steps=200", "publish.every_steps=1000"],
                            cwd=tmp_path,
                            env=runner.env(real_trainer=True, OUTPUT_DIR=str(out), NPROC="2", PYTHONPATH=str(REPO)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers = two_workers(proc)
        metrics = out / "metrics" / "train.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, proc, 240, "step 2")
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert not alive(workers)
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["reason"]) == ("stopped", "SIGTERM")
    rows = [json.loads(ln)["step"] for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]
    # the step in flight saved
    assert rows == list(range(1, run["step"] + 1)) and trainer_state.peek(out)["step"] == run["step"]
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == [f"checkpoint-{run['step']}"]


KILL_ARGS = ["budget.max_steps=2", "publish.every_steps=1", "publish.keep=2", "optim.lr=0.01"]


def _weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(ckpt / "model.safetensors")


@pytest.mark.slow
def test_sigkill_of_every_rank_while_the_state_is_written_then_a_rerun_ends_bit_for_bit(tmp_path, runner):
    ref = tmp_path / "ref"  # (the reference and the rerun: ranks in children of the warm runner; the killed run's
    # ranks are started as always, with the planted slow write)
    r = subprocess.run(torchrun_cmd(ref, *KILL_ARGS, python=runner.python), cwd=tmp_path, env=env(PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

    out = tmp_path / "out"
    proc = subprocess.Popen(torchrun_cmd(out, *KILL_ARGS), cwd=tmp_path, env=fault_env(tmp_path, "slow_state"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        workers = two_workers(proc)
        state_dir = out / "state"
        # the step-2 state is being written: rank 1 is slow, in the middle of its tensors
        wait_for(lambda: state_dir.is_dir()
                 and any(p.name.startswith(".tmp-trainer_state-2-") for p in state_dir.iterdir()),
                 proc, 240, "the step-2 state write")
        time.sleep(0.5)
        for pid in [proc.pid, *workers]:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not still_alive(workers)  # (SIGKILLed: on their way out, if not yet gone)
    kept = trainer_state.peek(out)
    assert kept["step"] == 1 and kept["path"].name == "trainer_state-1"  # the half-written one is not a state
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["checkpoint-1"]

    r = subprocess.run(torchrun_cmd(out, *KILL_ARGS, python=runner.python), cwd=tmp_path, env=env(PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and [p.name for p in (out / "state").iterdir()] == ["trainer_state-2"]
    a, b = _weights(ref / "checkpoints" / "checkpoint-2"), _weights(out / "checkpoints" / "checkpoint-2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

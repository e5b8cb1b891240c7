"""The end of the wall budget, as pure parts: the saves' reserve (measured, or estimated from bytes over a
probed write rate), the point a rollout must end by, a run's start time, the stop-request flag and the
abandon check (``opdkit.interrupt``), and the vLLM engine driven step by step (a stand-in engine)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from opdkit import deadline, interrupt
from opdkit.engines.vllm import generate
from procs import env


def test_the_saves_are_estimated_from_their_bytes_until_they_are_measured_then_the_longest_counts():
    clock = deadline.SaveClock(state_bytes=21_000_000_000, export_bytes=3_500_000_000, rate_bps=2e9, factor=2.0)
    total, parts = clock.reserve()
    assert parts["state"]["s"] == pytest.approx(21.0) and parts["export"]["s"] == pytest.approx(3.5)
    assert total == pytest.approx(24.5)
    assert parts["state"]["basis"].startswith("estimated: 21.00 GB at the probe's 2.00 GB/s x 2")
    e = clock.record("state", 100, 21_000_000_000, 8.4)
    assert e == {"what": "state", "step": 100, "gb": 21.0, "s": 8.4, "gb_per_s": 2.5}
    clock.record("state", 200, 21_000_000_000, 12.0)
    clock.record("state", 300, 21_000_000_000, 9.0)
    total, parts = clock.reserve()
    assert parts["state"] == {"s": 12.0, "basis": "measured"} and total == pytest.approx(12.0 + 3.5)
    unestimated = {"s": 0.0, "basis": "not estimated (budget.write_probe_mb=0)"}
    assert deadline.SaveClock(1, 1, 0.0, 2.0).reserve() == (0.0, {k: unestimated for k in ("state", "export")})


def test_the_byte_estimates_are_weights_and_two_adam_moments_and_the_export_in_its_dtype(tiny_llama):
    n = sum(p.numel() for p in tiny_llama.parameters())
    assert deadline.state_bytes(tiny_llama) == n * 4 * 3
    assert deadline.export_bytes(tiny_llama, torch.bfloat16) == n * 2
    frozen = [p.requires_grad_(False) for p in list(tiny_llama.parameters())[1:]]
    try:
        assert deadline.state_bytes(tiny_llama) == next(tiny_llama.parameters()).numel() * 4 * 3
    finally:
        for p in frozen:
            p.requires_grad_(True)


def test_the_rollout_ends_where_the_rest_of_its_step_and_the_saves_still_fit():
    # 300 s budget, 60 s reserve, 30 s of saves, 10 s of scoring and update after the rollout, 150 s spent
    assert deadline.rollout_deadline_s(300.0, 60.0, 30.0, 10.0, 150.0) == 50.0
    assert deadline.rollout_deadline_s(300.0, 60.0, 30.0, 10.0, 260.0) == -60.0  # already past: the next token ends it
    assert deadline.rollout_deadline_s(0.0, 60.0, 30.0, 10.0, 150.0) is None  # no wall budget


def test_the_write_probe_measures_each_file_system_once_and_leaves_nothing(tmp_path):
    a, b = tmp_path / "state", tmp_path / "checkpoints"
    rate = deadline.probe_write_rate([a, b], 4 << 20)
    assert rate > 0 and list(a.iterdir()) == [] and list(b.iterdir()) == []
    assert deadline.probe_write_rate([a], 0) == 0.0


def test_the_run_starts_at_run_shs_launch_else_at_the_process_start(monkeypatch):
    monkeypatch.setenv(deadline.LAUNCH_ENV, f"{time.time() - 42.0:.3f}")
    assert time.monotonic() - deadline.started_at() == pytest.approx(42.0, abs=0.5)
    monkeypatch.delenv(deadline.LAUNCH_ENV)
    code = ("import time; t0 = time.monotonic(); time.sleep(1.0); from opdkit import deadline; "
            "print(t0 - deadline.started_at())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env())
    assert 0.0 <= float(out.stdout) < 1.0  # the interpreter's start, before anything ran (clock ticks: 10 ms)


def test_check_abandon_raises_in_the_armed_thread_only_past_its_deadline_or_after_a_stop_signal(monkeypatch):
    interrupt.check_abandon()  # nothing armed: nothing happens
    with interrupt.deadline(time.monotonic() + 60):
        interrupt.check_abandon()
        raised = []

        def other():
            try:
                interrupt.check_abandon()
            except interrupt.StepAbandoned as e:
                raised.append(e)

        t = threading.Thread(target=other)
        monkeypatch.setattr(interrupt, "_received", signal.SIGTERM)
        t.start()
        t.join()
        assert raised == []  # a background thread (a prefetch) is not cut
        with pytest.raises(interrupt.StepAbandoned) as e:
            interrupt.check_abandon()
        assert e.value.reason == "SIGTERM" and not isinstance(e.value, Exception)  # no `except Exception` swallows it
        monkeypatch.setattr(interrupt, "_received", None)
    with interrupt.deadline(time.monotonic() - 1):
        with pytest.raises(interrupt.StepAbandoned, match="wall_clock"):
            interrupt.check_abandon()
    interrupt.check_abandon()  # disarmed again


def test_a_library_that_replaces_the_handlers_gets_them_put_back():
    code = textwrap.dedent("""
        import os, signal, time
        from opdkit import interrupt
        with interrupt.stop_on_signals():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what a library's engine might do
            print(interrupt.ensure_installed(print), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            print("flag", interrupt.requested(), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=60, env=env())
    assert proc.returncode == 0, proc.stderr
    said = "a library replaced opdkit's stop-signal handler for SIGTERM (was <Handlers.SIG_DFL: 0>); put it back"
    assert said in proc.stdout
    assert proc.stdout.splitlines()[-1] == f"flag {int(signal.SIGTERM)}"


class _Out:
    def __init__(self, rid: str, finished: bool):
        self.request_id, self.finished = rid, finished


class _Engine:
    """vLLM 0.26's LLMEngine as the driver sees it: requests finish one per step, in reverse order."""

    def __init__(self, n: int):
        self.left, self.aborted, self.steps = list(range(n)), None, 0

    def has_unfinished_requests(self):
        return bool(self.left)

    def step(self):
        self.steps += 1
        return [_Out(str(self.left.pop()), True), _Out("x", False)]

    def abort_request(self, ids, internal=False):
        self.aborted = (list(ids), internal)
        self.left = []


class _LLM:
    def __init__(self, n: int):
        self.llm_engine, self.enqueued = _Engine(n), None

    def enqueue(self, prompts, sampling_params, use_tqdm):
        self.enqueued = (prompts, sampling_params, use_tqdm)
        return [f"{i}-internal" for i in range(len(prompts))]


def test_the_vllm_engine_is_driven_step_by_step_and_an_abandoned_rollout_aborts_its_requests():
    llm = _LLM(5)
    outs = generate(llm, ["p"] * 5, ["sp"] * 5)
    assert [o.request_id for o in outs] == ["0", "1", "2", "3", "4"] and llm.enqueued == (["p"] * 5, ["sp"] * 5, False)
    assert llm.llm_engine.aborted is None
    llm = _LLM(5)
    with interrupt.deadline(time.monotonic() - 1):  # past its deadline before the first step
        with pytest.raises(interrupt.StepAbandoned):
            generate(llm, ["p"] * 5, ["sp"] * 5)
    assert llm.llm_engine.steps == 0 and llm.llm_engine.aborted == ([f"{i}-internal" for i in range(5)], True)

"""One-step-off rollouts (``rollout.overlap: 1``, opdkit.overlap): with weights that do not change
the run is the on-policy run step for step; with learning, step n trains on the batch the weights
before step n-1's update drew, with the log-probs recorded while drawing it (checked against the
step recomputed from the library's step functions); a run stopped by a signal resumes as if
uninterrupted; the engines are asked for sampling log-probs only where they are read."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opdkit import interrupt, opd, step as opd_step
from opdkit.config import load_config
from opdkit.engines.base import Rollout
from opdkit.engines.hf import HFEngine
from opdkit.overlap import Lookahead
from opdkit.setup import RunError, build_run, prepare_inputs
from opdkit.train import prompt_indices, train

TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "runtime.threads=1", "budget.max_wall_time_s=0", "optim.schedule=constant", "optim.warmup_steps=0"]


def cfg(*overrides: str):
    return load_config(None, [*TINY, *overrides])


def run(out: Path, *overrides: str) -> list[dict]:
    logs: list[str] = []
    train(cfg(*overrides), out, log=logs.append, progress=False)
    return [json.loads(ln) for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]


KEYS = ("loss", "kl", "grad_norm", "tokens", "ratio_max")


@pytest.mark.parametrize("loss", ["k1", "rkl"])
def test_with_weights_that_do_not_change_overlap_is_the_on_policy_run(tmp_path, loss):
    """lr = 0: the batch drawn ahead by the previous weights is the batch the current ones draw, so
    every logged number is the on-policy run's, bit for bit (the prefetch answers the right step's
    prompts and seeds, in the right order)."""
    common = ("budget.max_steps=3", "optim.lr=0.0", f"loss.name={loss}")
    on = run(tmp_path / "on", *common)
    off = run(tmp_path / "off", *common, "rollout.overlap=1")
    assert [r["rollout_lag"] for r in off] == [0, 1, 1]
    for a, b in zip(on, off):
        assert {k: a.get(k) for k in KEYS} == {k: b.get(k) for k in KEYS}


@pytest.mark.parametrize("extra", [("loss.name=k1",), ("loss.name=rkl",)], ids=["k1", "rkl"])
def test_step_2_trains_on_the_batch_the_initial_weights_drew(tmp_path, extra):
    """lr > 0: step 1 is the on-policy step; step 2's loss is the loss of the weights after step 1 on
    the batch that the initial weights drew for step 2's prompts and seeds, with the log-probs
    recorded while drawing it as the PPO reference (recomputed here from the library's step
    functions): k1's stale ratio is used, not an on-policy one; rkl takes the stale prefixes as drawn."""
    common = ("budget.max_steps=2", "optim.lr=3e-3", "publish.every_steps=1", "publish.keep=2", *extra)
    on = run(tmp_path / "on", *common)
    off = run(tmp_path / "off", *common, "rollout.overlap=1")
    assert on[0]["loss"] == off[0]["loss"] and on[1]["loss"] != off[1]["loss"]

    c = cfg(*common)
    inputs = prepare_inputs(c)
    r = build_run(c, inputs, log=lambda s: None)  # the initial weights, θ0
    P, G = c.rollout.prompts_per_step, c.rollout.samples_per_prompt
    examples = [inputs.examples[i] for i in prompt_indices(c.seed, len(inputs.examples), P, P)]
    ro = HFEngine(r.student, r.tokenizer).sample(r.prompts(examples), samples_per_prompt=G,
                                                  seeds=opd.step_seeds(c.seed, 1, P * G), temperature=1.0, top_p=1.0,
                                                  max_new_tokens=c.rollout.max_new_tokens)
    theta1 = load_file(tmp_path / "on" / "checkpoints" / "checkpoint-1" / "model.safetensors")
    assert not r.student.load_state_dict(theta1, strict=False).unexpected_keys  # θ1 (the same in both runs)
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    kw = {"rollout": c.rollout, "runtime": c.runtime, "micro_batch": c.optim.micro_batch}
    contexts = opd_step.score_batch(c.loss, r.teacher, batch, r.autocast, **kw)
    m = opd_step.micro_losses(c.loss, r.student, batch, contexts, r.autocast, **kw)
    assert abs(m["loss"] - off[1]["loss"]) < 1e-6 and abs(m["kl"] - off[1]["kl"]) < 1e-6
    if c.loss.name == "k1":
        assert off[1]["ratio_max"] > 1.0 + 1e-4  # the behaviour log-probs are θ0's


def test_an_overlap_run_stopped_by_a_signal_resumes_as_if_uninterrupted(tmp_path, monkeypatch):
    """The batch prefetched for step 3 is saved with the state at the stop and trained after the
    resume: the same weights and losses as 4 steps in one go."""
    common = ("budget.max_steps=4", "optim.lr=3e-3", "loss.name=k1", "rollout.overlap=1", "publish.every_steps=4")
    ref = run(tmp_path / "ref", *common)
    calls = {"n": 0}

    def stop_after_two_steps() -> int:  # read once at the top of each step
        calls["n"] += 1
        return int(signal.SIGTERM) if calls["n"] > 2 else 0

    monkeypatch.setattr(interrupt, "requested", stop_after_two_steps)
    first = train(cfg(*common), tmp_path / "out", log=lambda s: None, progress=False)
    assert (first.status, first.step) == ("stopped", 2)
    monkeypatch.undo()
    logs: list[str] = []
    train(cfg(*common), tmp_path / "out", log=logs.append, progress=False)
    rows = [json.loads(ln) for ln in (tmp_path / "out" / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref] and [r["rollout_lag"] for r in rows] == [0, 1, 1, 1]
    assert any("alignment check skipped" in ln for ln in logs)
    a = load_file(tmp_path / "out" / "checkpoints" / "checkpoint-4" / "model.safetensors")
    b = load_file(tmp_path / "ref" / "checkpoints" / "checkpoint-4" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("loss,asked", [(("rkl",), [True, False, False]), (("k1",), [True, True, True]),
                                        (("rkl", "loss.reward_weight=0.5"), [True, True, True])],
                         ids=["rkl", "k1", "rkl+reward"])
def test_sampling_logprobs_are_asked_for_only_where_they_are_read(tmp_path, monkeypatch, loss, asked):
    """rkl reads no sampling log-probs: only the first batch (the alignment check) asks for them; k1's
    PPO ratio reads them at every step, and so does the reward's policy-gradient term beside rkl."""
    seen: list[bool] = []
    real = HFEngine.sample

    def spy(self, prompts, **kw):
        seen.append(kw["logprobs"])
        return real(self, prompts, **kw)

    monkeypatch.setattr(HFEngine, "sample", spy)
    run(tmp_path / "out", "budget.max_steps=3", f"loss.name={loss[0]}", *loss[1:])
    assert seen == asked


def test_a_loss_that_reads_log_probs_the_engine_did_not_record_stops_loudly(tiny_llama, tok):
    c = cfg("loss.name=k1")
    ids = [tok("Compute 3+4.").input_ids]
    ro = HFEngine(tiny_llama, tok).sample(ids, samples_per_prompt=2, seeds=[1, 2], temperature=1.0, top_p=1.0,
                                          max_new_tokens=6)
    ro.sampling_logp_B_T = None  # as vLLM returns it when asked for none
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    kw = {"rollout": c.rollout, "runtime": c.runtime, "micro_batch": c.optim.micro_batch}
    ctx = opd_step.score_batch(c.loss, tiny_llama, batch, contextlib.nullcontext, **kw)
    with pytest.raises(ValueError, match="without its sampling log-probs"):
        opd_step.micro_losses(c.loss, tiny_llama, batch, ctx, contextlib.nullcontext, **kw)


# --- the wrapper on its own, with a stand-in engine ------------------------------------------


class StandIn:
    """Draws a one-token 'rollout' whose token is the sum of the seeds plus the weights' version."""

    reads_live_model = False

    def __init__(self, fail_on=None):
        self.version, self.fail_on, self.pushes = 0, fail_on, 0
        self.gate = threading.Event()
        self.gate.set()

    def sync_weights(self, model):
        self.version = model
        self.pushes += 1

    def sample(self, prompts, *, seeds, logprobs=True, **kw):
        self.gate.wait(5)
        if self.fail_on is not None and seeds[0] == self.fail_on:
            raise RuntimeError("drawing failed")
        tok = torch.tensor([[sum(seeds) + 100 * self.version]])
        one = torch.ones(1, 1)
        return Rollout(torch.tensor([prompts[0]]), one.long(), tok, one, one * 0 if logprobs else None,
                       torch.tensor([False]), torch.tensor([0]))


KW = dict(samples_per_prompt=1, temperature=1.0, top_p=1.0, max_new_tokens=1)


def test_the_prefetch_draws_with_the_weights_of_the_last_push_and_waits_before_the_next():
    eng = StandIn()
    ahead = Lookahead(eng, contextlib.nullcontext, torch.device("cpu"))
    ahead.sync_weights(1)
    first = ahead.sample([[5]], seeds=[1], **KW)
    assert ahead.lag == 0 and int(first.completion_ids_B_T) == 101
    eng.gate.clear()  # the prefetch blocks until released ...
    ahead.prefetch([[6]], seeds=[2], **KW)  # re-pushes version 1 first: the engine drew since the last push
    assert eng.pushes == 2
    threading.Timer(0.2, eng.gate.set).start()
    ahead.sync_weights(2)  # ... and the push of version 2 waits for it
    assert ahead.pop_waited() > 0.1 and eng.version == 2
    got = ahead.sample([[6]], seeds=[2], **KW)
    assert ahead.lag == 1 and int(got.completion_ids_B_T) == 102  # drawn by version 1, not 2
    with pytest.raises(RuntimeError, match="a prefetch is already pending"):
        ahead.prefetch([[7]], seeds=[3], **KW)
        ahead.prefetch([[7]], seeds=[3], **KW)


def test_a_prefetch_for_other_seeds_or_a_failed_one_is_raised_in_the_callers_thread():
    ahead = Lookahead(StandIn(fail_on=9), contextlib.nullcontext, torch.device("cpu"))
    ahead.sync_weights(1)
    ahead.prefetch([[6]], seeds=[2], **KW)
    with pytest.raises(RuntimeError, match="other prompts or seeds"):
        ahead.sample([[6]], seeds=[3], **KW)
    ahead = Lookahead(StandIn(fail_on=9), contextlib.nullcontext, torch.device("cpu"))
    ahead.sync_weights(1)
    ahead.prefetch([[6]], seeds=[9], **KW)
    with pytest.raises(RuntimeError, match="drawing failed"):
        ahead.sample([[6]], seeds=[9], **KW)


def test_an_engine_that_reads_the_live_model_is_refused(tiny_llama, tok):
    with pytest.raises(ValueError, match="own copy"):
        Lookahead(HFEngine(tiny_llama, tok), contextlib.nullcontext, torch.device("cpu"))
    copy = HFEngine(tiny_llama, tok, own_copy=True)
    assert not copy.reads_live_model and copy.model is not tiny_llama


@pytest.mark.parametrize("overrides,match", [
    (["rollout.overlap=1", "loss.name=sft", "loss.sft_source=reference"], "does not sample the student"),
    # the reward term's per-token ratio corrects neither the stale prefix nor the sequence-level reward
    (["rollout.overlap=1", "loss.name=rkl", "loss.reward_weight=0.5"], "reward_weight=0.5 with rollout.overlap=1"),
])
def test_bad_overlap_params_are_refused_before_anything_is_written(tmp_path, overrides, match):
    with pytest.raises(RunError, match=match):
        train(cfg("budget.max_steps=1", *overrides), tmp_path / "out", log=lambda s: None, progress=False)
    assert not (tmp_path / "out").exists()


def test_overlap_under_torchrun_is_refused(monkeypatch):
    from opdkit import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RunError, match="one process"):
        distributed.check_params(cfg("rollout.overlap=1"), distributed.current())

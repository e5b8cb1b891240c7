"""Scale-out (opdkit.distributed): FSDP2 sharding, gathering state, and torchrun runs on CPU/gloo.

Fast tier: a world of one process (gloo, in this process) exercises the sharded code paths: the
direct decoder/head calls of the loss through FSDP2, gathered trainer state and exports equal to an
unsharded model's, full parameters for rollouts.

Slow tier: ``torchrun --nproc-per-node 2 -m opdkit train`` on the embedded default: after one step
the loss and the weights match a single-process run over the same global batch; the 2-process run
publishes valid checkpoints, resumes (2 processes, and 1 process from a 2-process state), and ends
with the single-process run's weights.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from opdkit import distributed
from opdkit.config import load_config
from opdkit.embedded import asset
from opdkit.engines.weights import export_state_dict
from opdkit.models import load_model
from opdkit.persist import trainer_state
from opdkit.persist.checkpoints import validate_checkpoint
from opdkit.scoring import unwrap
from opdkit.setup import RunError, make_optimizer
from student_weights import trainable_state

REPO = Path(__file__).resolve().parents[1]
# the issue-22 shape: up to 64 new tokens, so the ranks' longest completions differ (39 and 40 tokens at
# step 1), and logprob_chunk=1, so do their numbers of position chunks (a hang before the fix)
TINY = ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=64", "runtime.threads=1",
        "runtime.logprob_chunk=1", "budget.max_wall_time_s=0", "optim.schedule=cosine", "publish.every_steps=1"]
WEIGHT_TOL = 1e-6  # fp32 on CPU: only the order of float sums differs between 1 and 2 processes


# --- single process: World() ------------------------------------------------------------------


def test_the_single_process_world_is_the_identity():
    w = distributed.World()
    assert (w.rank, w.size, w.is_main, w.active) == (0, 1, True, False)
    assert w.share(8) == slice(0, 8)
    assert w.sum(3, 4.5) == (3.0, 4.5) and w.broadcast(2.0) == (2.0,) and w.from_main("x") == "x"
    m = {"loss": 1.0, "tokens": 5.0}
    assert distributed.reduce_metrics(m, w) is m


def test_ranks_share_the_prompts_contiguously_and_the_count_must_divide(monkeypatch):
    shares = [distributed.World(rank=r, size=4).share(8) for r in range(4)]
    assert [list(range(8))[s] for s in shares] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(RunError, match=r"multiple of the number of ranks \(4\)"):
        distributed.check_params(load_config(None, ["rollout.prompts_per_step=6"]),
                                 distributed.World(size=4, active=True))
    monkeypatch.setenv("WORLD_SIZE", "4")  # `WORLD_SIZE=4 opdkit train --check`, before torchrun starts
    with pytest.raises(RunError, match=r"multiple of the number of ranks \(4\)"):
        distributed.check_params(load_config(None, ["rollout.prompts_per_step=6"]), distributed.World())


def test_vllm_under_torchrun_is_refused_before_anything_is_written_and_auto_picks_hf(monkeypatch, tmp_path, runner):
    from opdkit.config import ConfigError
    from opdkit.engines import select, vllm

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it, and run.sh's --check for NPROC=2
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm is not supported under torchrun with 2 processes"):
        distributed.check_params(load_config(None, ["rollout.engine=vllm"]), distributed.World())
    monkeypatch.setattr(vllm, "available", lambda: True)  # a CUDA machine with vLLM installed ...
    monkeypatch.setattr(select.decode_kernels, "available", lambda: False)  # ... and no Triton
    assert select.engine_name(load_config(None, ["rollout.engine=auto"]), torch.device("cuda")) == "hf"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert select.engine_name(load_config(None, ["rollout.engine=auto"]), torch.device("cuda")) == "vllm"
    monkeypatch.setattr(select.decode_kernels, "available", lambda: True)  # with Triton: the static decoder's kernels
    assert select.engine_name(load_config(None, ["rollout.engine=auto"]), torch.device("cuda")) == "hf"
    # run.sh with NPROC=2: bad input (exit 2, one line), and nothing is written (its preflight `python -m opdkit
    # train --check`: a child of the warm runner, conftest)
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(REPO / "run.sh"), "rollout.engine=vllm"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env=runner.env(OUTPUT_DIR=str(out), NPROC="2", PYTHONPATH=str(REPO)))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not supported under torchrun" in r.stderr, r.stderr
    assert not out.exists()


def test_metrics_are_token_weighted_over_ranks(monkeypatch):
    w = distributed.World(size=2, active=True)
    parts = [{"loss": 0.2, "tokens": 10.0, "kl": 1.0, "ratio_max": 2.0, "x": None},
             {"loss": 0.4, "tokens": 30.0, "kl": 3.0, "ratio_max": 5.0, "x": None}]
    monkeypatch.setattr(distributed.World, "gather", lambda self, obj: parts)
    out = distributed.reduce_metrics(parts[0], w)
    assert out["tokens"] == 40.0 and out["loss"] == pytest.approx(0.3)  # each rank's loss is over global tokens / 2
    assert out["kl"] == pytest.approx((10 * 1 + 30 * 3) / 40) and out["ratio_max"] == 5.0 and out["x"] is None


# --- a world of one process: the sharded code paths --------------------------------------------


@pytest.fixture
def world1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield distributed.World(rank=0, size=1, device=torch.device("cpu"), active=True)
    finally:
        dist.destroy_process_group()


def _student(lora: bool):
    torch.manual_seed(0)
    model = load_model(asset("student"), torch.device("cpu"), trainable=True)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
        with torch.no_grad():  # a trained adapter: B != 0, so merging changes the weights
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
    return model.train()


def _loss_as_opd_computes_it(model) -> torch.Tensor:
    """The decoder and the head called directly (not the root's forward), head chunk by chunk."""
    decoder, head = unwrap(model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    h = decoder(input_ids=ids, use_cache=False).last_hidden_state
    h_leaf = h.detach().requires_grad_(True)
    total = 0.0
    for s in range(0, 6, 4):
        logp = head(h_leaf[:, s:s + 4]).float().log_softmax(-1)
        loss = -logp.gather(-1, ids[:, s:s + 4, None]).mean()
        loss.backward()
        total += float(loss.detach())
    h.backward(h_leaf.grad)
    return total


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_sharded_step_and_its_gathered_state_equal_the_unsharded_ones(world1, lora):
    cfg = load_config(None, ["optim.lr=0.01", f"lora.enabled={str(lora).lower()}"])
    plain = _student(lora)
    sharded = copy.deepcopy(plain)
    distributed.shard_model(sharded, world1)
    assert distributed.is_sharded(sharded) and not distributed.is_sharded(plain)
    assert type(next(sharded.parameters())).__name__ == "DTensor"
    opts = [make_optimizer(cfg, m, torch.device("cpu")) for m in (plain, sharded)]
    for _ in range(2):  # two steps: the second reads the optimizer state the first wrote
        losses = [_loss_as_opd_computes_it(m) for m in (plain, sharded)]
        assert losses[0] == pytest.approx(losses[1], abs=1e-6)
        norms = [distributed.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], 1.0)
                 for m in (plain, sharded)]
        assert norms[0] == pytest.approx(norms[1], rel=1e-5)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

    def assert_close(a: dict, b: dict):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k].float(), b[k].float(), atol=1e-6), k

    assert_close(export_state_dict(plain), distributed.gather_weights(sharded))
    o_plain, o_sharded = _full_optimizer_state(plain, opts[0]), _full_optimizer_state(sharded, opts[1])
    assert o_plain["param_groups"] == o_sharded["param_groups"]
    assert o_plain["state"].keys() == o_sharded["state"].keys()
    for name in o_plain["state"]:
        assert_close(o_plain["state"][name], o_sharded["state"][name])


def _full_optimizer_state(model, optimizer) -> dict:
    """The optimizer state by parameter name, full tensors (gathered from the shards of a sharded model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def test_full_params_gives_plain_full_tensors_for_generation_and_shards_again(world1):
    plain = _student(lora=False).eval()
    sharded = distributed.shard_model(copy.deepcopy(plain), world1)
    ids = torch.tensor([[5, 6, 7, 8]])
    with distributed.full_params(sharded):
        assert all(type(p) is torch.nn.Parameter for p in sharded.parameters())
        out = sharded.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, plain.generate(input_ids=ids, max_new_tokens=6, do_sample=False))
    assert all(type(p).__name__ == "DTensor" for p in sharded.parameters())


def test_forwards_of_the_whole_model_under_full_params_leave_it_gathered(world1):
    """The HF engine's decode loop calls the root's forward once per token, and ranks decode different
    numbers of tokens: inside ``full_params`` no forward may reshard anything (the next would gather it
    again, a collective that the other ranks do not run). The root's forward calls the decoder and head
    that ``shard_model`` routes through the root for opd's direct calls. (A world of one process runs
    FSDP's gathers as local copies, so the layout is what is checked, not the collectives.)"""
    sharded = distributed.shard_model(_student(lora=False).eval(), world1)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), distributed.full_params(sharded):
        for t in range(3):
            sharded(input_ids=ids[:, :2 + t], use_cache=False, logits_to_keep=1)
            resharded = [n for n, p in sharded.named_parameters() if type(p) is not torch.nn.Parameter]
            assert resharded == [], f"forward {t}: {resharded[:3]}"
    assert all(type(p).__name__ == "DTensor" for p in sharded.parameters())
    decoder, _ = unwrap(sharded)
    with torch.no_grad():  # outside the block a direct decoder call still gathers the root and its layers
        h = decoder(input_ids=ids, use_cache=False).last_hidden_state
    plain = _student(lora=False).eval()
    torch.testing.assert_close(h, plain.model(input_ids=ids, use_cache=False).last_hidden_state)


def test_shard_run_carries_a_restored_optimizer_state_over_and_the_sharded_state_saves_and_restores(world1, tmp_path):
    from opdkit.setup import Run, build_run, prepare_inputs

    cfg = load_config(None, ["runtime.threads=1", "budget.max_steps=1", "optim.lr=0.01"])
    run = build_run(cfg, prepare_inputs(cfg), log=lambda *_: None)
    _loss_as_opd_computes_it(run.student)
    run.optimizer.step()
    before = _full_optimizer_state(run.student, run.optimizer)
    weights = {k: v.clone() for k, v in trainable_state(run.student).items()}
    sharded: Run = distributed.shard_run(run, world1)
    assert sharded.optimizer is not run.optimizer and sharded.student is run.student
    after = _full_optimizer_state(sharded.student, sharded.optimizer)
    assert after["param_groups"] == before["param_groups"]
    for name, s in before["state"].items():
        for k, v in s.items():
            assert torch.equal(after["state"][name][k], v), (name, k)
    # the trainer state of the sharded run (DTensor shards, written through the process group) is
    # the unsharded run's: restored into a fresh, unsharded run
    sharded.lr_clock_start_s = 0.0
    trainer_state.save(tmp_path, sharded, step=1, elapsed=0.0, data_pos=0, log=lambda *_: None)
    fresh = build_run(cfg, prepare_inputs(cfg), log=lambda *_: None)
    trainer_state.restore(fresh, trainer_state.peek(tmp_path))
    assert all(torch.equal(v, weights[k]) for k, v in trainable_state(fresh.student).items())
    restored = _full_optimizer_state(fresh.student, fresh.optimizer)
    for name, s in before["state"].items():
        for k, v in s.items():
            assert torch.equal(restored["state"][name][k], v), (name, k)


# --- torchrun, 2 processes ---------------------------------------------------------------------


def _torchrun(runner, out: Path, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """torchrun, ``nproc`` ranks of ``python -m opdkit train``, each rank's interpreter the warm runner's (conftest;
    ``--no-python``: torchrun runs ``RUNNER_PYTHON -m opdkit train ...`` as the rank, whose command runs in a child
    of the runner with the rank's environment, stdout and stderr): spared a fresh interpreter's imports per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--no-python", str(runner.python),
           "-m", "opdkit", "train", "--out", str(out), "-p", "none", "--quiet"]  # built-in defaults, as _single
    for kv in [*TINY, *overrides]:
        cmd += ["-S", kv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # a hang fails here


def _single(out: Path, *overrides: str):
    from opdkit.train import train

    return train(load_config(None, [*TINY, *overrides]), out, log=lambda *_: None, progress=False)


def _rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]


def _max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One process, 2 steps over the same global batches (a checkpoint per step)."""
    out = tmp_path_factory.mktemp("single") / "out"
    assert _single(out, "budget.max_steps=2", "runtime.teacher_sharding=fsdp").step == 2
    return out


@pytest.mark.slow
def test_two_processes_match_one_then_publish_and_resume(tmp_path, reference, runner):
    out = tmp_path / "out"
    # the first start stops at step 1 of the reference's 2-step cosine (its horizon kept for the resumes)
    r = _torchrun(runner, out, "budget.max_steps=1", "budget.schedule_steps=2", "runtime.teacher_sharding=fsdp")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["step"] == 1  # rank 0 alone prints the result

    ref, two = _rows(reference)[0], _rows(out)[0]
    d_loss, d_w = abs(ref["loss"] - two["loss"]), _max_weight_diff(reference / "checkpoints/checkpoint-1",
                                                                     out / "checkpoints/checkpoint-1")
    print(f"1 vs 2 processes after one step: max |dloss| {d_loss:.3g}, max |dweight| {d_w:.3g}")
    assert ref["tokens"] == two["tokens"] and ref["truncated_frac"] == two["truncated_frac"]  # the same samples
    assert d_loss < 1e-6 and d_w < WEIGHT_TOL
    assert ref["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-5)
    validate_checkpoint(out / "checkpoints/checkpoint-1")
    assert json.loads((out / "run.json").read_text())["status"] == "completed"

    # the 2-process state resumes under 1 process (another world size) ...
    other = tmp_path / "other"
    shutil.copytree(out, other)
    assert _single(other, "budget.max_steps=2", "budget.schedule_steps=2", "runtime.teacher_sharding=fsdp").step == 2
    # ... and under 2 processes; both end with the single-process run's weights
    r = _torchrun(runner, out, "budget.max_steps=2", "budget.schedule_steps=2", "runtime.teacher_sharding=fsdp")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert [row["step"] for row in _rows(out)] == [1, 2]
    validate_checkpoint(out / "checkpoints/checkpoint-2")
    for d in (out, other):
        d_w = _max_weight_diff(reference / "checkpoints/checkpoint-2", d / "checkpoints/checkpoint-2")
        print(f"{d.name}: after resuming to step 2, max |dweight| vs one process {d_w:.3g}")
        assert d_w < WEIGHT_TOL
        assert _rows(d)[1]["loss"] == pytest.approx(_rows(reference)[1]["loss"], abs=1e-6)


@pytest.mark.slow
def test_two_processes_with_lora_match_one(tmp_path, runner):
    ref, out = tmp_path / "single", tmp_path / "two"
    overrides = ["budget.max_steps=1", "lora.enabled=true", "optim.lr=0.01", "loss.name=k1", "optim.micro_batch=2"]
    _single(ref, *overrides)
    r = _torchrun(runner, out, *overrides)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    d_loss = abs(_rows(ref)[0]["loss"] - _rows(out)[0]["loss"])
    d_w = _max_weight_diff(ref / "checkpoints/checkpoint-1", out / "checkpoints/checkpoint-1")
    print(f"LoRA, 1 vs 2 processes: max |dloss| {d_loss:.3g}, max |dweight| {d_w:.3g}")
    assert d_loss < 1e-6 and d_w < WEIGHT_TOL
    validate_checkpoint(out / "checkpoints/checkpoint-1")


@pytest.mark.slow
def test_a_world_size_that_does_not_divide_the_prompts_is_bad_input(tmp_path, runner):
    r = _torchrun(runner, tmp_path / "out", "budget.max_steps=1", "rollout.prompts_per_step=3")
    assert r.returncode != 0 and "multiple of the number of ranks (2)" in r.stderr
    assert not (tmp_path / "out").exists()

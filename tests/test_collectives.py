"""Several ranks whose completions differ in length: every rank issues the same collectives, the
head's gradient is reduced once per micro-batch, and the update is the one-process update.

One ``torchrun`` of 2 gloo processes (``tests/collective_worker.py``) runs one update per case on
a global batch of 4 rows whose completions are 9, 7, 3 and 2 tokens long: rank 0 holds the first
two (T = 9), rank 1 the last two (T = 3), so with ``runtime.logprob_chunk`` 1 or 3 their numbers of
position chunks differ (9 vs 3, 3 vs 1) — before the fix that hung the first step. Each rank counts
the collectives its process group ran (the profiler's ``c10d::`` events); the reference is the same
update in one process over the whole batch (``collective_worker.one_step`` with ``World()``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from collective_worker import LENGTHS, build, one_step
from opdkit import distributed
from opdkit.embedded import asset
from procs import env

REPO = Path(__file__).resolve().parents[1]
# relative, per tensor: fp32 on CPU, only the order of float sums differs (the suite's grad_norm tolerance)
GRAD_TOL = 1e-5
N_LAYERS = json.loads((Path(asset("student")) / "config.json").read_text())["num_hidden_layers"]

CASES = {
    f"{tune}-chunk{c}-{'unpadded' if unp else 'padded'}": [
        f"runtime.logprob_chunk={c}", f"runtime.unpadded_rows={str(unp).lower()}",
        *(["lora.enabled=true", "lora.r=4"] if tune == "lora" else []),
    ]
    for tune in ("full", "lora") for c in (1, 3) for unp in (False, True)
}
CASES["full-chunk3-padded-2micro"] = ["runtime.logprob_chunk=3", "optim.micro_batch=1"]
CASES["full-chunk1-unpadded-fsdp_teacher-checkpointed"] = [  # S1 checkpoints activations
    "runtime.logprob_chunk=1", "runtime.unpadded_rows=true", "runtime.teacher_sharding=fsdp",
    "runtime.grad_checkpointing=true"]
# the reward in k1's advantage, and as a policy-gradient term beside rkl (opdkit.rewards)
for loss in ("k1", "rkl"):
    CASES[f"full-chunk1-padded-{loss}+reward"] = ["runtime.logprob_chunk=1", f"loss.name={loss}",
                                                  "loss.reward_weight=0.5"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("collectives")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests" / "collective_worker.py"), str(out),
           json.dumps({name: {"overrides": o} for name, o in CASES.items()})]
    r = subprocess.run(cmd, cwd=REPO, env=env(PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}"),
                       capture_output=True, text=True, timeout=300)  # a hang fails here, not after 30 min
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return out


def _ranks(out: Path, case: str) -> list[dict]:
    return [json.loads((out / case / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_ranks_with_different_completion_lengths_issue_the_same_collectives(two_ranks, case):
    r0, r1 = _ranks(two_ranks, case)
    assert (r0["T"], r1["T"]) == (max(LENGTHS[:2]), max(LENGTHS[2:]))  # the ranks' T differ ...
    if "chunk1" in case:
        assert r0["chunks"] != r1["chunks"]  # ... and so do their numbers of position chunks
    print(f"{case}: T {r0['T']}/{r1['T']}, chunks {r0['chunks']}/{r1['chunks']}, step collectives {r0['step']}")
    assert r0["step"] == r1["step"] and r0["micro_losses"] == r1["micro_losses"]


@pytest.mark.slow
def test_head_and_layers_are_gathered_and_reduced_once_per_micro_batch(two_ranks):
    """The loss's collectives do not grow with the number of position chunks, nor with rows run one
    by one: per micro-batch one all-gather of the root and two of each layer (forward, backward),
    one reduce-scatter of each unit that has trainable parameters (LoRA: the layers only)."""
    ml = {case: _ranks(two_ranks, case)[0]["micro_losses"] for case in CASES}
    for tune in ("full", "lora"):
        same = {json.dumps(ml[f"{tune}-chunk{c}-{u}"], sort_keys=True) for c in (1, 3) for u in ("padded", "unpadded")}
        assert len(same) == 1, (tune, same)
    assert ml["full-chunk1-padded"]["_allgather_base_"] == 1 + 2 * N_LAYERS
    assert ml["full-chunk1-padded"]["_reduce_scatter_base_"] == 1 + N_LAYERS
    assert ml["lora-chunk1-padded"]["_reduce_scatter_base_"] == N_LAYERS
    two = ml["full-chunk3-padded-2micro"]  # two micro-batches: twice the gathers and reductions
    assert two["_allgather_base_"] == 2 * (1 + 2 * N_LAYERS) and two["_reduce_scatter_base_"] == 2 * (1 + N_LAYERS)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_two_rank_update_equals_the_one_process_update(two_ranks, case):
    """The clipped gradient the optimizer steps with, tensor by tensor, and the loss and norm, as
    tests/test_distributed.py compares them. (Not the AdamW-stepped weights: its first step is
    lr * g / (|g| + eps), which turns the fp32 rounding of near-zero gradient entries — the ranks pad
    to other widths than one process — into differences of order lr.)"""
    cfg, run, batch = build(CASES[case], distributed.World())  # the whole global batch, one process
    ref = one_step(cfg, run, batch, distributed.World())
    two = load_file(two_ranks / case / "grads.safetensors")
    assert ref["grads"].keys() == two.keys()
    assert all(float(g.norm()) > 0 for g in ref["grads"].values())  # every tensor has a gradient to compare
    rel = {k: float((two[k] - g).norm() / g.norm()) for k, g in ref["grads"].items()}
    m = _ranks(two_ranks, case)[0]["metrics"]
    print(f"{case}: max relative L2 gradient difference {max(rel.values()):.3g} ({max(rel, key=rel.get)}), "
          f"|dloss| {abs(ref['metrics']['loss'] - m['loss']):.3g}")
    assert max(rel.values()) < GRAD_TOL
    assert m["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-6)  # a loss of ~8: fp32 rounding
    assert m["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    assert m["tokens"] == ref["metrics"]["tokens"] == sum(LENGTHS)

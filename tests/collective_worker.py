"""One training update on a fixed global batch, under ``torchrun`` (gloo) or in one process.

Run by ``tests/test_collectives.py``::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/collective_worker.py OUT CASES_JSON

For each case (a name and params overrides) every rank builds the run as the trainer does
(``build_run``, then ``shard_run``), takes its share of a global batch of ``LENGTHS`` completion
tokens per row (so the ranks' longest completions, and hence their numbers of position chunks,
differ), and runs the loop's update phase: teacher scoring, ``step.micro_losses``, the metrics
reduction, the clipped global norm and the optimizer step. Each rank writes
``OUT/<case>/rank<r>.json``: the collectives it issued in that update and in ``micro_losses``
alone (``count_collectives``: every collective, whoever issues it, counted where gloo runs it), its
T and chunk count;
rank 0 also writes the gradients the optimizer stepped with (``OUT/<case>/grads.safetensors``).

``one_step`` with ``distributed.World()`` is the single-process reference over the same global
batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.profiler import record_function

from opdkit import distributed, guards, opd, step as opd_step
from opdkit.config import load_config
from opdkit.engines.base import Rollout, left_pad
from opdkit.engines.weights import full
from opdkit.setup import build_run, prepare_inputs

BASE = ["runtime.threads=1", "runtime.device=cpu", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "budget.max_steps=1", "optim.schedule=constant", "optim.warmup_steps=0", "optim.lr=0.01"]
PROMPT_LENS = (5, 8, 4, 6)  # of the global batch's rows (repeated for more rows)
LENGTHS = (9, 7, 3, 2)  # completion tokens per row (2 prompts x 2 samples): T is 9 on rank 0 (rows 0-1), 3 on rank 1
# with loss.reward_weight: each row's group-centred reward (opdkit.rewards), planted
REWARD_ADV = (1.0, -1.0, 0.5, -0.5)


@contextlib.contextmanager
def count_collectives():
    """Within the block, every collective this process issues, counted by the profiler where the
    process group runs it (its ``c10d::<op>`` events: FSDP2's all-gathers and reduce-scatters,
    DTensor's reductions in the clipped norm, ``World``'s), by op; those inside a ``record_function(name)`` block are
    also counted under ``name``. Yields ``{"all": Counter, name: Counter, ...}``, filled on exit."""
    from torch.profiler import ProfilerActivity, profile

    counts: dict[str, Counter] = {"all": Counter()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield counts
    events = prof.events()
    spans = [(e.name, e.time_range) for e in events if e.name.startswith("opdkit:")]
    for e in events:
        if not e.name.startswith("c10d::"):
            continue
        op = e.name.removeprefix("c10d::")
        counts["all"][op] += 1
        for name, span in spans:
            if span.start <= e.time_range.start <= span.end:
                counts.setdefault(name, Counter())[op] += 1


def global_batch(vocab: int, eos_id: int, lengths=LENGTHS) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) token lists of the global batch, deterministic; each completion ends with EOS."""
    g = torch.Generator().manual_seed(1234)
    rows = []
    for i, n_c in enumerate(lengths):
        n_p = PROMPT_LENS[i % len(PROMPT_LENS)]
        prompt = torch.randint(3, vocab, (n_p,), generator=g).tolist()
        comp = torch.randint(3, vocab, (n_c - 1,), generator=g).tolist() + [eos_id]
        rows.append((prompt, comp))
    return rows


def make_batch(rows, pad_id: int) -> opd.Batch:
    """Rows laid out as an engine lays out its rollout: prompts left-padded, completions right-padded
    to the longest of *these* rows (a rank's T is its own longest completion)."""
    ids_B_Sp, mask_B_Sp = left_pad([p for p, _ in rows], pad_id)
    T = max(len(c) for _, c in rows)
    comp_B_T = torch.full((len(rows), T), pad_id, dtype=torch.long)
    cmask_B_T = torch.zeros((len(rows), T))
    for i, (_, c) in enumerate(rows):
        comp_B_T[i, : len(c)] = torch.tensor(c)
        cmask_B_T[i, : len(c)] = 1
    ro = Rollout(ids_B_Sp, mask_B_Sp, comp_B_T, cmask_B_T, torch.zeros_like(cmask_B_T),
                 torch.zeros(len(rows), dtype=torch.bool), torch.arange(len(rows)))
    return opd.Batch(ro, ids_B_Sp, mask_B_Sp)


def build(overrides: list[str], world: distributed.World, lengths=LENGTHS):
    cfg = load_config(None, [*BASE, *overrides])
    run = build_run(cfg, prepare_inputs(cfg), log=lambda *_: None)
    if cfg.lora.enabled:  # a trained adapter (B != 0), so that every adapter weight has a gradient
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for n, p in run.student.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    if world.active:
        run = distributed.shard_run(run, world)
    tok = run.tokenizer
    rows = global_batch(len(tok), tok.eos_token_id, lengths)
    batch = make_batch(rows[world.share(len(rows))], tok.pad_token_id)
    if cfg.loss.reward_weight:
        batch.reward_adv_B = torch.tensor(REWARD_ADV[: len(rows)])[world.share(len(rows))]
    return cfg, run, batch


def one_step(cfg, run, batch: opd.Batch, world: distributed.World) -> dict:
    """The training loop's update phase (``opdkit.train``) on ``batch``. Returns the metrics, the
    collectives counted (over the whole update, and in ``micro_losses``), this rank's T and chunk
    count, and ``grads``: the clipped gradients the optimizer stepped with, full (unsharded) tensors."""
    with count_collectives() as counts:
        settings = {"rollout": cfg.rollout, "runtime": cfg.runtime, "micro_batch": cfg.optim.micro_batch}
        contexts = opd_step.score_batch(cfg.loss, run.teacher, batch, run.autocast, run.teacher_ctx, **settings)
        (n_tok,) = world.sum(batch.rollout.n_tokens)
        with record_function("opdkit:micro_losses"):
            m = opd_step.micro_losses(cfg.loss, run.student, batch, contexts, run.autocast, n_tokens=n_tok / world.size,
                                      **settings)
        m = distributed.reduce_metrics(m, world)
        trainable = [p for p in run.student.parameters() if p.requires_grad]
        m["grad_norm"] = distributed.clip_grad_norm_(trainable, cfg.optim.grad_clip)
        grads = {n: p.grad.detach().clone() for n, p in run.student.named_parameters() if p.requires_grad}
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        guards.check_parameters(trainable, 1)
    T = batch.rollout.completion_ids_B_T.shape[1]
    return {"metrics": m, "step": dict(counts["all"]), "micro_losses": dict(counts.get("opdkit:micro_losses", {})),
            "T": T, "chunks": math.ceil(T / cfg.runtime.logprob_chunk),
            "grads": {n: full(g) for n, g in grads.items()}}  # gathered (collective) after the count


def main(out: Path, cases: dict[str, dict]) -> None:
    """``cases``: {name: {"overrides": [...], "lengths": [...] (optional, default ``LENGTHS``)}}."""
    torch.set_num_threads(1)
    world = distributed.init(load_config(None, BASE).runtime)
    try:
        for name, case in cases.items():
            cfg, run, batch = build(case["overrides"], world, case.get("lengths", LENGTHS))
            result = one_step(cfg, run, batch, world)
            grads = result.pop("grads")
            d = out / name
            d.mkdir(parents=True, exist_ok=True)
            (d / f"rank{world.rank}.json").write_text(json.dumps(result))
            if world.is_main:
                save_file({k: v.contiguous() for k, v in grads.items()}, d / "grads.safetensors")
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))

"""One OPD step as separate functions: rollout -> teacher scoring -> per-token signal -> loss.

Each can be called from a notebook. The training loop (``opdkit.train``) strings them together.

``Batch`` holds the sampled sequences of one step; ``micro_losses`` runs the loss over them in
micro-batches and calls ``backward`` itself, chunk by chunk over positions: the student's final
hidden states are computed once with grad, then each chunk's logits -> loss -> backward runs on a
detached copy, and the accumulated hidden-state gradient is pushed through the decoder at the
end. Only one chunk of (B, C, V) logits exists at a time, for any loss.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from opdkit import losses
from opdkit.config import Config
from opdkit.engines.base import Rollout, left_pad
from opdkit.engines.sampling import sample_seed
from opdkit.teacher import Geometry, build_geometry, check_alignment, completion_hidden, token_logprobs, unwrap

SAMPLED_LOSSES = ("k1", "k3", "sft")
FULL_LOSSES = ("fkl", "rkl", "jsd")


@dataclass
class Batch:
    """One step's sequences: the rollout plus the teacher's view of the same completions."""

    rollout: Rollout
    teacher_prompt_ids_B_Sp: torch.Tensor  # = the rollout's prompts, or privileged prompts
    teacher_prompt_mask_B_Sp: torch.Tensor


def step_seeds(seed: int, step: int, n: int, offset: int = 0) -> list[int]:
    """Per-sample seeds of ``step`` for global sample indices ``offset .. offset+n-1``."""
    return [sample_seed(seed, step, offset + i) for i in range(n)]


def reference_rollout(prompts: list[list[int]], solutions: list[list[int]], pad_id: int, eos_id: int, device) -> Rollout:
    """Reference solutions laid out like a rollout (for the ``sft`` control on references)."""
    ids_B_Sp, mask_B_Sp = left_pad(prompts, pad_id, device)
    comps = [s + [eos_id] for s in solutions]
    T = max(map(len, comps))
    comp_B_T = torch.full((len(comps), T), pad_id, dtype=torch.long)
    cmask_B_T = torch.zeros((len(comps), T))
    for i, c in enumerate(comps):
        comp_B_T[i, : len(c)] = torch.tensor(c)
        cmask_B_T[i, : len(c)] = 1
    return Rollout(ids_B_Sp, mask_B_Sp, comp_B_T.to(device), cmask_B_T.to(device), torch.zeros_like(cmask_B_T).to(device),
                   torch.zeros(len(comps), dtype=torch.bool, device=device), torch.arange(len(comps), device=device))


def teacher_geometry(batch: Batch, rows: slice = slice(None)) -> Geometry:
    ro = batch.rollout
    return build_geometry(batch.teacher_prompt_ids_B_Sp[rows], batch.teacher_prompt_mask_B_Sp[rows],
                          ro.completion_ids_B_T[rows], ro.completion_mask_B_T[rows])


def student_geometry(batch: Batch, rows: slice = slice(None)) -> Geometry:
    ro = batch.rollout
    return build_geometry(ro.prompt_ids_B_Sp[rows], ro.prompt_mask_B_Sp[rows],
                          ro.completion_ids_B_T[rows], ro.completion_mask_B_T[rows])


def alignment_report(batch: Batch, student, chunk: int, unpadded: bool = False) -> dict:
    """The alignment self-check on a batch, plus how far recomputed student log-probs are from
    the sampling-time ones (they should agree to float tolerance on the first step)."""
    ro = batch.rollout
    out = check_alignment(student_geometry(batch), ro.completion_ids_B_T, ro.completion_mask_B_T, ro.prompt_mask_B_Sp)
    out.update(check_alignment(teacher_geometry(batch), ro.completion_ids_B_T, ro.completion_mask_B_T,
                               batch.teacher_prompt_mask_B_Sp))
    with torch.no_grad():
        _, head = unwrap(student)
        logp_B_T = token_logprobs(head, completion_hidden(student, student_geometry(batch), unpadded), ro.completion_ids_B_T,
                                   chunk)
    m = ro.completion_mask_B_T.bool()
    out["recompute_max_abs_dlogp"] = float((logp_B_T - ro.sampling_logp_B_T).abs()[m].max()) if m.any() else 0.0
    return out


def _combine(parts: list[dict]) -> dict:
    """Token-weighted means of chunk metrics (``tokens`` summed, ``*_max`` maxed)."""
    total = sum(p.get("tokens", 0.0) for p in parts)
    out: dict = {"tokens": total}
    for key in {k for p in parts for k in p} - {"tokens"}:
        vals = [(p[key], p.get("tokens", 0.0)) for p in parts if key in p and p[key] is not None]
        if key.endswith("_max"):
            out[key] = max(v for v, _ in vals) if vals else None
        else:
            out[key] = sum(v * w for v, w in vals) / total if total else None
    return out


def _chunk_loss(cfg: Config, h_s_B_C_H, s_head, t_ctx, sl, ro: Rollout, rows: slice, n_tokens: float):
    """Loss and metrics of positions ``sl`` of micro-batch ``rows``."""
    L = cfg.loss
    ids_B_C = ro.completion_ids_B_T[rows, sl]
    mask_B_C = ro.completion_mask_B_T[rows, sl]
    logits_B_C_V = s_head(h_s_B_C_H).float()
    if L.name in SAMPLED_LOSSES:
        logp_B_C = logits_B_C_V.log_softmax(-1).gather(-1, ids_B_C[..., None])[..., 0]
        if L.name == "sft":
            loss, m = losses.sft_loss(logp_B_C, mask_B_C, n_tokens)
            t_B_C = t_ctx["logp_B_T"][:, sl] if t_ctx else None
            if t_B_C is not None and L.sft_source == "teacher":  # forward KL estimate on teacher samples
                m["kl"] = float(((t_B_C - logp_B_C.detach()) * mask_B_C).sum() / mask_B_C.sum().clamp_min(1))
            return loss, m
        fn = losses.k1_loss if L.name == "k1" else losses.k3_loss
        return fn(logp_B_C, ro.sampling_logp_B_T[rows, sl], t_ctx["logp_B_T"][:, sl], mask_B_C, n_tokens, L.clip_eps)
    if L.name == "topk_fkl":
        loss, m = losses.topk_fkl_loss(logits_B_C_V, t_ctx["topk_ids_B_T_K"][:, sl], t_ctx["topk_logp_B_T_K"][:, sl],
                                       mask_B_C, n_tokens, L.tail_bucket)
        # top-K gives no exact reverse KL: report the sampled (k1) estimate on the student's tokens
        logp_B_C = logits_B_C_V.detach().log_softmax(-1).gather(-1, ids_B_C[..., None])[..., 0]
        m["kl"] = float(((logp_B_C - t_ctx["logp_B_T"][:, sl]) * mask_B_C).sum() / mask_B_C.sum().clamp_min(1))
        return loss, m
    with torch.no_grad():
        t_logp_B_C_V = t_ctx["head"](t_ctx["hidden_B_T_H"][:, sl]).float().log_softmax(-1)
    tau = L.clip_tau if L.clip != "none" else math.inf
    if L.name == "fkl":
        return losses.fkl_loss(logits_B_C_V, t_logp_B_C_V, mask_B_C, n_tokens, L.clip, tau)
    if L.name == "rkl":
        return losses.rkl_loss(logits_B_C_V, t_logp_B_C_V, mask_B_C, n_tokens, L.clip, tau)
    return losses.jsd_loss(logits_B_C_V, t_logp_B_C_V, mask_B_C, n_tokens, L.jsd_beta, L.clip, tau)


@torch.no_grad()
def teacher_context(cfg: Config, teacher, batch: Batch, rows: slice, teacher_ctx_manager=contextlib.nullcontext) -> dict | None:
    """What the loss needs from the teacher for micro-batch ``rows`` (None if nothing)."""
    L = cfg.loss
    if L.name == "sft" and L.sft_source == "reference":
        return None
    ro = batch.rollout
    with teacher_ctx_manager():
        _, head = unwrap(teacher)
        h_B_T_H = completion_hidden(teacher, teacher_geometry(batch, rows), cfg.runtime.unpadded_rows)
        ids_B_T = ro.completion_ids_B_T[rows]
        ctx = {"logp_B_T": token_logprobs(head, h_B_T_H, ids_B_T, cfg.runtime.logprob_chunk), "head": head}
        if L.name == "topk_fkl":
            from opdkit.teacher import topk_logprobs

            ctx["topk_ids_B_T_K"], ctx["topk_logp_B_T_K"] = topk_logprobs(head, h_B_T_H, L.topk, cfg.runtime.logprob_chunk)
        elif L.name in FULL_LOSSES:
            ctx["hidden_B_T_H"] = h_B_T_H
    return ctx


def micro_slices(cfg: Config, batch: Batch) -> list[slice]:
    B = batch.rollout.completion_ids_B_T.shape[0]
    mb = cfg.optim.micro_batch or B
    return [slice(s, min(B, s + mb)) for s in range(0, B, mb)]


def score_batch(cfg: Config, teacher, batch: Batch, autocast, teacher_ctx_manager=contextlib.nullcontext) -> list:
    """Teacher scoring of every micro-batch of the step (no grad)."""
    with autocast():
        return [teacher_context(cfg, teacher, batch, rows, teacher_ctx_manager) for rows in micro_slices(cfg, batch)]


def micro_losses(cfg: Config, student, batch: Batch, contexts: list, autocast, n_tokens: float | None = None) -> dict:
    """Forward + backward of the whole step in micro-batches; returns combined metrics.

    ``contexts`` are ``score_batch``'s per-micro-batch teacher outputs. Gradients accumulate in
    ``student``'s parameters; the loss is the token mean over the whole step (every micro-batch
    divides by the step's token count). ``n_tokens`` overrides that count: a rank of a sharded run
    holds part of the step and passes the global count / world size (FSDP averages over ranks).
    """
    ro = batch.rollout
    n_tokens = max(1.0, float(ro.completion_mask_B_T.sum()) if n_tokens is None else n_tokens)
    chunk = cfg.runtime.logprob_chunk
    parts, total = [], 0.0
    _, s_head = unwrap(student)
    for rows, t_ctx in zip(micro_slices(cfg, batch), contexts):
        with autocast():
            h_B_T_H = completion_hidden(student, student_geometry(batch, rows), cfg.runtime.unpadded_rows)
        h_leaf = h_B_T_H.detach().requires_grad_(True)
        for s in range(0, h_leaf.shape[1], chunk):
            sl = slice(s, s + chunk)
            with autocast():
                loss, m = _chunk_loss(cfg, h_leaf[:, sl], s_head, t_ctx, sl, ro, rows, n_tokens)
            loss.backward()  # into h_leaf.grad and the head's parameters; frees this chunk's logits
            total += float(loss.detach())
            parts.append(m)
        h_B_T_H.backward(h_leaf.grad)  # through the decoder, once per micro-batch
    out = _combine(parts)
    out["loss"] = total
    return out

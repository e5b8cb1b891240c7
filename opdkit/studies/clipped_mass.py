"""Clipped mass: what a clipped forward-KL loss throws away, on real student rollouts.

At every completion position of the student's samples, the teacher's and the student's
full-vocabulary log-probs (reference geometry) give the forward-KL summands
``p_T(v) log(p_T(v) / p_S(v))``. For each tau in ``studies.clip_tau``:

- entry clip (``loss.clip=entry``: each summand -> min(summand, tau), clipped entries get no
  gradient): ``clipped_mass`` = mean over positions of the teacher probability mass in clipped
  entries, that share by bins of the true per-token KL (``clipped_mass_by_kl``; bins
  ``studies.kl_bins`` over the reverse KL(student || teacher), the kit's ``kl``),
  ``argmax_clipped_rate`` = share of positions whose teacher-argmax entry is clipped, and
  ``grad_cosine`` = cosine between the gradients w.r.t. the student logits of the clipped and the
  unclipped ``losses.fkl_loss`` (flattened over all positions and the vocabulary);
- token clip (``loss.clip=token``: the position's KL capped at tau, gradient rescaled):
  ``clipped_frac`` = share of positions whose forward KL exceeds tau, and its ``grad_cosine``.

tau = inf clips nothing (mass 0, cosine 1); tau = 0 clips every positive summand.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from opdkit import losses
from opdkit.config import Config
from opdkit.scoring import full_logprobs, unwrap
from opdkit.stats import kl_bin_means
from opdkit.studies.common import new_figure, position_chunks, prepare, row_chunks, study_header, tau_label, write_json
from opdkit.studies.padding import hidden_at, reference_geometry

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)  # levels reported in ``kl_quantiles``


def entry_clip_stats(student_logp_B_T_V: torch.Tensor, teacher_logp_B_T_V: torch.Tensor, tau: float):
    """Per position, for the entry clip at ``tau`` of the forward-KL summands.

    Returns ``(mass_B_T, argmax_clipped_B_T)``: the teacher probability mass in clipped entries,
    and whether the teacher's argmax entry is clipped (bool). Same clipping rule as
    ``losses.entry_clip_terms`` (an entry is clipped when its summand > tau).
    """
    assert student_logp_B_T_V.shape == teacher_logp_B_T_V.shape and student_logp_B_T_V.dim() == 3
    terms_B_T_V = losses._fkl_terms(student_logp_B_T_V, teacher_logp_B_T_V)
    _, clipped_B_T_V = losses.entry_clip_terms(terms_B_T_V, tau)
    p_T_B_T_V = teacher_logp_B_T_V.exp()
    mass_B_T = torch.where(clipped_B_T_V, p_T_B_T_V, torch.zeros_like(p_T_B_T_V)).sum(-1)
    argmax_B_T = teacher_logp_B_T_V.argmax(-1)
    return mass_B_T, clipped_B_T_V.gather(-1, argmax_B_T[..., None])[..., 0]


def fkl_grad(student_logits_B_T_V, teacher_logp_B_T_V, mask_B_T, n_tokens, clip="none", tau=math.inf) -> torch.Tensor:
    """Gradient of ``losses.fkl_loss`` w.r.t. the student logits (a fresh leaf copy): (B, T, V)."""
    leaf_B_T_V = student_logits_B_T_V.detach().float().requires_grad_(True)
    loss, _ = losses.fkl_loss(leaf_B_T_V, teacher_logp_B_T_V, mask_B_T, n_tokens, clip=clip, tau=tau)
    (grad_B_T_V,) = torch.autograd.grad(loss, leaf_B_T_V)
    return grad_B_T_V


class _Cosine:
    """Cosine between two long vectors fed chunk by chunk: <a, b> / (|a| |b|), NaN if either is 0."""

    def __init__(self):
        self.ab = self.aa = self.bb = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a, b = a.double().flatten(), b.double().flatten()
        self.ab += float(a @ b)
        self.aa += float(a @ a)
        self.bb += float(b @ b)

    def value(self) -> float:
        return self.ab / math.sqrt(self.aa * self.bb) if self.aa > 0 and self.bb > 0 else math.nan

    def norm_ratio(self) -> float:
        """|a| / |b|."""
        return math.sqrt(self.aa / self.bb) if self.bb > 0 else math.nan


def clipped_mass_stats(chunks: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], n_tokens: float,
                       taus: list[float], kl_bins: list[float]) -> dict:
    """The study's numbers from (student logits B_T_V, teacher log-probs B_T_V, mask B_T) chunks.

    ``chunks`` may be a generator (one row chunk in memory at a time; T may differ per chunk);
    ``n_tokens``: masked-in positions over all chunks (the loss normalisation; the cosines do not
    depend on it). Returns the lists described in the module docstring, aligned with ``taus``.
    """
    if n_tokens <= 0:
        raise ValueError("clipped-mass study: no completion tokens to score (every sample was empty)")
    entry_cos = [_Cosine() for _ in taus]
    token_cos = [_Cosine() for _ in taus]
    kl, fkl, mass, argmax = [], [], [], []  # flat per-position values, one tensor per chunk
    for s_logits, t_logp, mask_B_T in chunks:
        m = mask_B_T != 0
        s_logp = s_logits.detach().float().log_softmax(-1)
        t_logp = t_logp.float()
        kl.append(losses.reverse_kl_per_token(s_logp, t_logp)[m])
        fkl.append(losses.forward_kl_per_token(s_logp, t_logp)[m])
        per_tau = [entry_clip_stats(s_logp, t_logp, tau) for tau in taus]
        mass.append(torch.stack([ms[m] for ms, _ in per_tau], dim=1))  # N_chunk x n_tau
        argmax.append(torch.stack([am[m] for _, am in per_tau], dim=1))
        g_none = fkl_grad(s_logits, t_logp, mask_B_T, n_tokens)
        for i, tau in enumerate(taus):
            entry_cos[i].add(fkl_grad(s_logits, t_logp, mask_B_T, n_tokens, "entry", tau), g_none)
            token_cos[i].add(fkl_grad(s_logits, t_logp, mask_B_T, n_tokens, "token", tau), g_none)
    kl_N = torch.cat(kl).clamp_min(0.0).cpu().numpy()  # float noise can make a KL of ~0 slightly negative
    fkl_N = torch.cat(fkl).cpu().numpy()
    mass_N_tau = torch.cat(mass).cpu().numpy()
    argmax_N_tau = torch.cat(argmax).float().cpu().numpy()
    by_kl = [kl_bin_means(mass_N_tau[:, i], kl_N, kl_bins) for i in range(len(taus))]
    return {
        "tau": list(taus),
        "clipped_mass": mass_N_tau.mean(axis=0).tolist(),
        "clipped_mass_by_kl": [[b["mean"] for b in bins] for bins in by_kl],
        "kl_bins": list(kl_bins),
        "kl_bin_counts": [b["count"] for b in by_kl[0]] if by_kl else [],
        "argmax_clipped_rate": argmax_N_tau.mean(axis=0).tolist(),
        "clipped_position_frac": (mass_N_tau > 0).mean(axis=0).tolist(),
        "grad_cosine": [c.value() for c in entry_cos],
        "grad_norm_ratio": [c.norm_ratio() for c in entry_cos],
        "token_clip": {
            "tau": list(taus),
            "clipped_frac": [float((fkl_N > tau).mean()) for tau in taus],
            "grad_cosine": [c.value() for c in token_cos],
            "grad_norm_ratio": [c.norm_ratio() for c in token_cos],
        },
        "kl_mean": float(kl_N.mean()),
        "kl_quantiles": {f"p{round(q * 100)}": float(np.quantile(kl_N, q)) for q in QUANTILES},
        "fkl_mean": float(fkl_N.mean()),
        "n_positions": int(kl_N.size),
    }


def score_chunks(student, teacher, ro, chunk: int, progress: bool = False):
    """Yield (student logits, teacher log-probs, mask) over the vocabulary at the reference
    geometry, about ``chunk`` positions at a time: hidden states per block of whole rows, logits
    per slice of positions of that block (``studies.common``: never (rows, T, V) at once)."""
    B, T = ro.completion_ids_B_T.shape
    for rows in tqdm(row_chunks(B, T, chunk), desc="clipped-mass study", unit="chunk", disable=not progress):
        sg = reference_geometry(ro.prompt_ids_B_Sp[rows], ro.prompt_mask_B_Sp[rows], ro.completion_ids_B_T[rows],
                                ro.completion_mask_B_T[rows])
        with torch.no_grad():
            s_h_B_T_H, t_h_B_T_H = hidden_at(student, sg), hidden_at(teacher, sg)
        for cols in position_chunks(s_h_B_T_H.shape[0], T, chunk):
            with torch.no_grad():
                s_logits_B_C_V = unwrap(student)[1](s_h_B_T_H[:, cols]).float()
                t_logp_B_C_V = full_logprobs(unwrap(teacher)[1], t_h_B_T_H[:, cols], chunk)
            yield s_logits_B_C_V, t_logp_B_C_V, ro.completion_mask_B_T[rows, cols]


def clipped_mass_study(cfg: Config, out: str | Path, progress: bool = True) -> dict:
    """Run the clipped-mass study; writes ``out/clipped_mass.json`` and three PNGs.

    JSON (tau and KL-bin edges as numbers, infinity as the string "inf"; NaN as null): ``tau``,
    ``clipped_mass``, ``argmax_clipped_rate``, ``clipped_position_frac`` (positions with any
    clipped entry), ``grad_cosine``, ``grad_norm_ratio`` (|clipped grad| / |unclipped grad|), all
    aligned with ``tau``; ``clipped_mass_by_kl`` (per tau, a list aligned with the bins
    ``kl_bins[i]..kl_bins[i+1]``; null for an empty bin), ``kl_bin_counts``; ``token_clip``
    {``tau``, ``clipped_frac``, ``grad_cosine``, ``grad_norm_ratio``}; ``kl_mean``,
    ``kl_quantiles`` {p10, p25, p50, p75, p90, p99} of the per-position reverse KL, ``fkl_mean``,
    ``n_positions``, ``seconds`` and provenance.
    """
    t0 = time.perf_counter()
    out = Path(out)
    taus = [float(t) for t in cfg.studies.clip_tau]
    if not taus or min(taus) < 0:
        raise ValueError(f"studies.clip_tau must be a non-empty list of values >= 0, got {list(cfg.studies.clip_tau)}")
    setup = prepare(cfg, progress)
    ro = setup.rollout
    chunks = score_chunks(setup.student, setup.teacher, ro, cfg.runtime.logprob_chunk, progress)
    stats = clipped_mass_stats(chunks, ro.n_tokens, taus, list(cfg.studies.kl_bins))
    result = {**stats, **study_header(cfg, setup), "rollout_seconds": setup.rollout_seconds,
              "seconds": time.perf_counter() - t0}
    plot_clipped_mass(result, out)
    return write_json(result, out / "clipped_mass.json")


def plot_clipped_mass(result: dict, out: Path) -> list[Path]:
    """``clipped_mass_vs_tau.png``, ``clipped_mass_by_kl.png``, ``grad_cosine_vs_tau.png`` in ``out``
    (tau on an evenly spaced categorical axis so that 0 and inf fit)."""
    out.mkdir(parents=True, exist_ok=True)
    taus = result["tau"]
    x = np.arange(len(taus))
    labels = [tau_label(t) for t in taus]

    def nums(vals):
        return np.asarray([np.nan if v is None else v for v in vals], dtype=float)

    fig, (ax,) = new_figure()
    ax.plot(x, nums(result["clipped_mass"]), "o-", label="teacher mass in clipped entries")
    ax.plot(x, nums(result["argmax_clipped_rate"]), "s--", label="teacher argmax clipped (rate)")
    ax.plot(x, nums(result["token_clip"]["clipped_frac"]), "^:", label="token clip: positions clipped")
    ax.set(xticks=x, xticklabels=labels, xlabel="tau", ylabel="share", ylim=(-0.02, 1.02),
           title=f"Clipped forward KL ({result['n_positions']} positions)")
    ax.legend(fontsize=8)
    paths = [out / "clipped_mass_vs_tau.png"]
    fig.savefig(paths[-1], dpi=120)

    fig, (ax,) = new_figure()
    edges = result["kl_bins"]
    bin_labels = [f"[{tau_label(lo)}, {tau_label(hi)})\nn={n}"
                  for lo, hi, n in zip(edges[:-1], edges[1:], result["kl_bin_counts"])]
    xb = np.arange(len(bin_labels))
    for tau, row in zip(taus, result["clipped_mass_by_kl"]):
        ax.plot(xb, nums(row), "o-", label=f"tau={tau_label(tau)}")
    ax.set(xticks=xb, xlabel="per-token KL(student || teacher) bin", ylabel="teacher mass in clipped entries",
           ylim=(-0.02, 1.02), title="Clipped mass by true KL")
    ax.set_xticklabels(bin_labels, fontsize=7)
    ax.legend(fontsize=7, ncol=2)
    paths.append(out / "clipped_mass_by_kl.png")
    fig.savefig(paths[-1], dpi=120)

    fig, (ax,) = new_figure()
    ax.plot(x, nums(result["grad_cosine"]), "o-", label="entry clip")
    ax.plot(x, nums(result["token_clip"]["grad_cosine"]), "s--", label="token clip")
    ax.set(xticks=x, xticklabels=labels, xlabel="tau", ylabel="cos(grad clipped, grad unclipped)",
           ylim=(-1.05, 1.05), title="Gradient direction kept by the clip")
    ax.axhline(0, color="0.6", lw=0.8)
    ax.legend(fontsize=8)
    paths.append(out / "grad_cosine_vs_tau.png")
    fig.savefig(paths[-1], dpi=120)
    return paths

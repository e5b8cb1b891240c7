"""The losses, declared once: what each needs from the teacher, how it is called, what it reports.

``LOSSES`` maps every ``loss.name`` to a ``LossSpec``. The training step (``opdkit.opd``) reads
it to decide what the teacher scores (``teacher``), which tensors the loss function gets
(``inputs``, by the names below) and with which params (``params``); the config validation, the
run checks (``opdkit.setup``), the loop (``opdkit.train``) and the CLI help read it too. The loss
functions themselves are pure tensor functions in ``opdkit.losses``.

Input names (``LossSpec.inputs``), per micro-batch chunk of completion positions:

- ``logp_B_T``: student log-probs of the sampled tokens (with grad)
- ``old_logp_B_T``: sampling-time log-probs of the same tokens (the importance-weight reference)
- ``teacher_logp_B_T``: teacher log-probs of the same tokens
- ``logits_B_T_V``: student logits (with grad)
- ``teacher_logp_B_T_V``: teacher log-probs over the vocabulary
- ``topk_ids_B_T_K``, ``topk_logp_B_T_K``: the teacher's top-K ids and their log-probs
- ``mask_B_T``, ``n_tokens``: completion mask; masked-in tokens of the whole step

This module imports nothing heavy (the config validation reads it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TEACHER_NEEDS = ("none", "recorded", "token", "topk", "full")  # what the teacher scores, cheapest first
_TOKEN = ("logp_B_T", "old_logp_B_T", "teacher_logp_B_T", "mask_B_T", "n_tokens")
_FULL = ("logits_B_T_V", "teacher_logp_B_T_V", "mask_B_T", "n_tokens")
_CLIP_METRICS = ("kl", "fkl", "clipped_mass", "clipped_frac", "topk_overlap", "tokens")


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: str  # the function's name in opdkit.losses
    inputs: tuple[str, ...]  # its positional arguments (names above)
    teacher: str  # what the teacher scores: token (sampled-token log-probs) | topk | full | none
    params: Callable[[Any], dict]  # its keyword arguments, from the loss config (``LossConfig``)
    metrics: tuple[str, ...]  # the keys of the metrics it returns
    divergence: str  # the divergence whose gradient its expected gradient is
    summary: str  # one line for the CLI help


def _clip_params(L) -> dict:
    return {"clip": L.clip, "tau": L.clip_tau if L.clip != "none" else math.inf}


LOSSES: dict[str, LossSpec] = {s.name: s for s in (
    LossSpec("k1", "k1_loss", _TOKEN, "token", lambda L: {"clip_eps": L.clip_eps, "dual_clip": L.dual_clip},
             ("kl", "advantage_mean", "ratio_clipped_frac", "dual_clipped_frac", "ratio_max", "tokens"),
             "KL(p_S || p_T)", "PPO policy gradient, per-token advantage log p_T - log p_S (loss.clip_eps, "
             "loss.dual_clip)"),
    LossSpec("k2", "k2_loss", _TOKEN, "token", lambda L: {}, ("kl", "k2", "ratio_max", "tokens"),
             "KL(p_S || p_T)", "1/2 (log p_S - log p_T)^2 of each sampled token, differentiated directly"),
    LossSpec("k3", "k3_loss", _TOKEN, "token", lambda L: {}, ("kl", "k3", "ratio_max", "tokens"),
             "KL(p_T || p_S)", "r - 1 - log r (r = p_T / p_S) of each sampled token, differentiated directly"),
    LossSpec("topk_fkl", "topk_fkl_loss", ("logits_B_T_V", "topk_ids_B_T_K", "topk_logp_B_T_K", "mask_B_T", "n_tokens"),
             "topk", lambda L: {"tail_bucket": L.tail_bucket},
             ("fkl_topk", "rkl_topk", "teacher_topk_mass", "student_topk_mass", "topk_overlap", "tokens"),
             "KL(p_T || p_S) over the teacher's top-K (+ tail bucket)",
             "forward KL over the teacher's top-K ids (loss.topk, loss.tail_bucket)"),
    LossSpec("fkl", "fkl_loss", _FULL, "full", _clip_params, _CLIP_METRICS, "KL(p_T || p_S)",
             "forward KL over the vocabulary (loss.clip, loss.clip_tau)"),
    LossSpec("rkl", "rkl_loss", _FULL, "full", _clip_params, _CLIP_METRICS, "KL(p_S || p_T)",
             "reverse KL over the vocabulary (loss.clip, loss.clip_tau)"),
    LossSpec("jsd", "jsd_loss", _FULL, "full", lambda L: {"beta": L.jsd_beta, **_clip_params(L)},
             _CLIP_METRICS + ("jsd",), "generalized JSD_beta(p_T, p_S)",
             "generalized JSD of GKD (loss.jsd_beta: 0 forward KL, 1 reverse KL)"),
    LossSpec("sft", "sft_loss", ("logp_B_T", "mask_B_T", "n_tokens"), "token", lambda L: {}, ("nll", "tokens"),
             "KL(p_data || p_S) (cross-entropy)", "control: supervised NLL of teacher samples or reference "
             "solutions (loss.sft_source)"),
)}
LOSS_NAMES = tuple(LOSSES)


def spec(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"loss.name={name!r}: expected one of {', '.join(LOSS_NAMES)}")
    return LOSSES[name]


def samples_from(L) -> str:
    """Who writes the completions the loss is computed on: student | teacher | reference."""
    return L.sft_source if L.name == "sft" else "student"


def teacher_need(L, R) -> str:
    """What the teacher scores for loss config ``L`` and rollout config ``R``: the loss's ``teacher``,
    except for the sft control: on references nothing (``none``); on teacher samples drawn at
    temperature 1 and top-p 1 nothing either (``recorded``): the log-prob the rollout recorded for
    each sampled token is then the teacher's own (the engines record it under the policy that
    sampled, which is the teacher's untempered, untruncated distribution), so its ``kl`` metric
    reads those instead of a second teacher pass. At other rollout settings the recorded value is
    the tempered or truncated policy's, not the teacher's: the teacher scores its samples (``token``)."""
    source = samples_from(L)
    if source == "reference":
        return "none"
    if source == "teacher" and R.temperature == 1.0 and R.top_p >= 1.0:
        return "recorded"
    return spec(L.name).teacher


def help_text() -> str:
    """One line per loss: name, what it is, the divergence its expected gradient follows."""
    return "\n".join(f"  {s.name:9s}{s.summary}; gradient of {s.divergence}" for s in LOSSES.values())

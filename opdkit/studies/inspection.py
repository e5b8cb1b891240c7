"""Rollout inspection: sampled completions with the per-token teacher - student log-prob.

``inspect_rollouts`` samples completions from the student exactly as a training step does (HF
engine, per-sample seeds from ``(seed, 0, index)``), then scores each sampled token with the
student and the teacher through the training path (``opd.Batch`` geometry, ``completion_hidden``,
``token_logprobs``). The per-token ``delta = log p_T - log p_S`` is the OPD per-token reward (the
negative of the k1 reverse-KL estimate): strongly negative where the teacher disagrees with what
the student sampled. ``tokens_html`` colours it for a notebook.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from opdkit import opd
from opdkit.engines.hf import HFEngine
from opdkit.engines.sampling import sample_seed
from opdkit.scoring import completion_hidden, token_logprobs, unwrap


@dataclass
class InspectedSample:
    """One sampled completion: its tokens (decoded one by one) and per-token log-probs."""

    prompt: str
    tokens: list[str]  # T_b decoded completion tokens (through EOS)
    logp_student: list[float]  # T_b: log p_S(token) recomputed under the sampling policy (its temperature, top-p)
    logp_teacher: list[float]  # T_b: log p_T(token)
    truncated: bool

    @property
    def delta(self) -> list[float]:
        """Per-token log p_T - log p_S."""
        return [t - s for t, s in zip(self.logp_teacher, self.logp_student)]

    @property
    def text(self) -> str:
        return "".join(self.tokens)


@torch.no_grad()
def inspect_rollouts(student, teacher, tokenizer, prompts: list[list[int]], *, seed: int, temperature: float,
                     top_p: float, max_new_tokens: int, chunk: int = 2048) -> list[InspectedSample]:
    """Sample one completion per prompt from ``student`` and score it with both models.

    ``prompts``: P token-id lists (encode with ``data.encode_prompt``). Returns P samples.
    """
    engine = HFEngine(student, tokenizer, static_cache=False)
    ro = engine.sample(prompts, samples_per_prompt=1, seeds=[sample_seed(seed, 0, i) for i in range(len(prompts))],
                       temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)  # teacher.source=model: same prompts
    ids_B_T = ro.completion_ids_B_T
    _, s_head = unwrap(student)
    _, t_head = unwrap(teacher)
    logp_s_B_T = token_logprobs(s_head, completion_hidden(student, opd.student_geometry(batch)), ids_B_T, chunk,
                                temperature, top_p)  # the student policy OPD differentiates (loss_table)
    logp_t_B_T = token_logprobs(t_head, completion_hidden(teacher, opd.teacher_geometry(batch)), ids_B_T, chunk)
    lengths_B = ro.completion_mask_B_T.sum(dim=1).long().tolist()
    out = []
    for b, n in enumerate(lengths_B):
        ids = ids_B_T[b, :n].tolist()
        out.append(InspectedSample(
            prompt=tokenizer.decode(prompts[b], skip_special_tokens=True),
            tokens=[tokenizer.decode([i], skip_special_tokens=False) for i in ids],
            logp_student=logp_s_B_T[b, :n].tolist(), logp_teacher=logp_t_B_T[b, :n].tolist(),
            truncated=bool(ro.truncated_B[b]),
        ))
    return out


def delta_colour(value: float, scale: float) -> str:
    """CSS background for a per-token delta: red where the teacher is less sure than the student
    (delta < 0), green where more sure, white at 0; saturates at ``|delta| = scale``."""
    a = max(-1.0, min(1.0, value / scale)) if scale > 0 else 0.0
    if a < 0:
        return f"rgba(220, 40, 40, {-a:.2f})"
    return f"rgba(40, 160, 60, {a:.2f})"


def tokens_html(tokens: list[str], values: list[float], scale: float = 2.0) -> str:
    """The tokens as coloured ``<span>``s (hover shows the value), in a monospace block."""
    if len(tokens) != len(values):
        raise ValueError(f"tokens_html: {len(tokens)} tokens but {len(values)} values")
    spans = [
        f'<span title="{v:+.3f}" style="background:{delta_colour(v, scale)}">{html.escape(t)}</span>'
        for t, v in zip(tokens, values)
    ]
    return '<div style="font-family:monospace;white-space:pre-wrap;line-height:1.6">' + "".join(spans) + "</div>"


def summary(samples: list[InspectedSample]) -> dict:
    """Token-level means over all samples: ``mean_delta`` (= minus the k1 estimate of
    KL(student || teacher) on the student's own samples), the share of tokens with delta < -1,
    the minimum, and counts."""
    deltas = [d for s in samples for d in s.delta]
    n = len(deltas)
    return {
        "n_samples": len(samples),
        "n_tokens": n,
        "mean_delta": sum(deltas) / n if n else float("nan"),
        "frac_delta_below_minus1": sum(d < -1.0 for d in deltas) / n if n else float("nan"),
        "min_delta": min(deltas) if n else float("nan"),
        "truncated_frac": sum(s.truncated for s in samples) / max(1, len(samples)),
    }

"""What the losses' expected gradients are off by where opdkit does not make them exact: one-step-off
rollouts (``rollout.overlap: 1``) and the reward term with a variable token count. Each number is
measured by exact enumeration (tests/bias_enumeration.py; tests/test_overlap_bias.py recomputes every
one and holds it to the two significant digits written here; ``python bench/overlap_bias.py`` prints
them), as a relative error |E[∇loss] - target| / |target| of the gradient in the student's logits.

The setup: a tabular autoregressive student (one logit vector per prefix: 3 ids, completions of 2
tokens, logits drawn N(0, 1.5²)), a tabular teacher (log-softmax of N(0, 1.5²)); the behaviour policy
of an overlapped step is the student one update behind, its logits the current ones plus N(0, sd²) on
every entry; medians over 5 random cases.

- ``OVERLAP_BIAS[loss, sd]``: a loss's expected gradient on completions drawn by the behaviour
  policy, with the behaviour's recorded log-probs as the importance reference, against the same loss
  on-policy. k2's and k3's per-token weight corrects the last token's distribution only: the prefix
  stays the behaviour's, exactly as for the full-vocabulary losses, so k2 = rkl and k3 = fkl (and k1
  without its clip = rkl) to the last digit; k1's PPO clip (0.2, dual clip 3) adds to that.
- ``UNREACHABLE_BIAS[loss]``: top-p < 1, one position, a constructed case whose current nucleus holds
  an id the behaviour's nucleus does not (tests/bias_enumeration.py ``NUCLEUS_CASE``): the behaviour never
  samples it, so the sampled-token losses lose its term; the full-vocabulary losses recompute the
  nucleus from the current logits at each prefix and are exact there (0).
- ``REWARD_OVERLAP_BIAS[clipped, sd]``: the reward term (groups of 3, leave-one-out baseline) drawn
  by the behaviour policy, its per-token PPO ratio against the behaviour's log-probs, against
  λ (G / n) ∇E[r]: uncorrected for the stale prefix and for the sequence-level reward. Hence opdkit
  refuses ``loss.reward_weight`` > 0 with ``rollout.overlap: 1`` (``rewards.check_params``).
- ``VARIABLE_COUNT_BIAS[G]``: on-policy, one prompt, G samples that stop at EOS (1 or 2 tokens), the
  reward term divided by the step's real token count n: its expected gradient against the identity
  of ``opdkit.rewards`` with n replaced by its mean, λ c (G / E[n]) ∇E[r]. The identity is exact for a
  fixed token count only; the error falls with the rows of a step (the same for both baselines).

Imports nothing (the CLI's help reads it).
"""

from __future__ import annotations

import textwrap

SHIFTS = (0.15, 0.5)  # the logit shift sd between the behaviour and the current student
OVERLAP_BIAS = {
    ("k1", 0.15): 0.022, ("k1", 0.5): 0.22,
    ("k1_noclip", 0.15): 0.020, ("k1_noclip", 0.5): 0.090,
    ("k2", 0.15): 0.020, ("k2", 0.5): 0.090,
    ("rkl", 0.15): 0.020, ("rkl", 0.5): 0.090,
    ("k3", 0.15): 0.012, ("k3", 0.5): 0.13,
    ("fkl", 0.15): 0.012, ("fkl", 0.5): 0.13,
    ("jsd", 0.15): 0.017, ("jsd", 0.5): 0.089,
}
UNREACHABLE_BIAS = {"k2": 0.40, "k1_noclip": 0.40, "k3": 0.63, "rkl": 0.0, "fkl": 0.0}
REWARD_OVERLAP_BIAS = {(True, 0.15): 0.13, (True, 0.5): 0.55, (False, 0.15): 0.087, (False, 0.5): 0.31}
VARIABLE_COUNT_BIAS = {2: 0.29, 3: 0.21, 4: 0.17}


def pct(x: float) -> str:
    """A stated relative error as a percentage, to its two significant digits."""
    return f"{100 * x:#.2g}".rstrip(".") + "%"


def help_text() -> str:
    """The statements for ``opdkit train --help``."""
    ov = {k: pct(v) for k, v in OVERLAP_BIAS.items()}
    text = (
        "rollout.overlap=1 (one-step-off rollouts) is not exact: the per-token importance weight of k1/k2/k3 corrects "
        "the last token's distribution only; the prefix stays the one the weights one update old drew, as for the "
        "full-vocabulary losses. Relative gradient error at a logit shift of sd 0.15 / 0.5 (exact enumeration, "
        f"docs/fidelity.md): k2 = rkl {ov['k2', 0.15]} / {ov['k2', 0.5]}, k3 = fkl {ov['k3', 0.15]} / "
        f"{ov['k3', 0.5]}, jsd {ov['jsd', 0.15]} / {ov['jsd', 0.5]}, k1 with its PPO clip {ov['k1', 0.15]} / "
        f"{ov['k1', 0.5]}; with top-p < 1 the sampled-token losses miss ids inside the current nucleus but outside "
        f"the stale one ({pct(UNREACHABLE_BIAS['k2'])} / {pct(UNREACHABLE_BIAS['k3'])} for k2 / k3 in a constructed "
        f"case). A reward (loss.reward_weight) with overlap is refused ({pct(REWARD_OVERLAP_BIAS[True, 0.15])} / "
        f"{pct(REWARD_OVERLAP_BIAS[True, 0.5])} off). The reward's identity E[grad] = lambda c (P G / n) grad E[r] "
        f"holds for a fixed token count n; with completions that stop at EOS it is off by "
        f"{pct(VARIABLE_COUNT_BIAS[2])} / {pct(VARIABLE_COUNT_BIAS[3])} / {pct(VARIABLE_COUNT_BIAS[4])} "
        "at G = 2 / 3 / 4 "
        "(one prompt, completions of 1-2 tokens), falling with the rows of a step.")
    return textwrap.fill(text, 100, initial_indent="  ", subsequent_indent="  ")

"""Every bias opdkit states (``opdkit.biases``: ``opdkit train --help`` and docs/fidelity.md) is the one
measured by exact enumeration (tests/bias_enumeration.py: opdkit's own loss functions, every completion
weighted by its probability, autograd), to the two significant digits it is stated with; the identities
behind them (k2's bias is rkl's, k3's fkl's, k1 unclipped rkl's) hold to the last digit; and the stated
numbers are the ones the help text and the docs print."""

from __future__ import annotations

from pathlib import Path

import pytest

import bias_enumeration as be
from opdkit import biases

ROOT = Path(__file__).resolve().parents[1]


def two_digits(x: float) -> str:
    return f"{x:#.2g}"


@pytest.fixture(scope="module")
def overlap():
    return be.overlap_table(biases.SHIFTS, n_cases=5, kinds=("k1", "k2", "k3", "jsd"))


def test_the_stale_prefix_bias_of_each_loss_is_the_stated_one(overlap):
    for (kind, sd), stated in biases.OVERLAP_BIAS.items():
        measured = overlap[{"k1_noclip": "k2", "rkl": "k2", "fkl": "k3"}.get(kind, kind), sd]  # the identities below
        assert two_digits(measured) == two_digits(stated), (kind, sd, measured)
    for sd in biases.SHIFTS:  # the clip adds to the stale prefix's bias; a larger shift, a larger bias
        assert overlap["k1", sd] > overlap["k2", sd]
    assert all(overlap[k, 0.5] > overlap[k, 0.15] for k in ("k1", "k2", "k3", "jsd"))


def test_k2s_bias_is_rkls_and_k3s_is_fkls():
    """The per-token weight corrects the last token only: a sampled-token loss with it has exactly the
    bias of the full-vocabulary loss that takes the same stale prefixes (k1 unclipped: rkl's too)."""
    case = be.overlap_errors((0.5,), seed=3, kinds=("k1_noclip", "k2", "k3", "rkl", "fkl"))
    assert case["k2", 0.5] == pytest.approx(case["rkl", 0.5], rel=1e-5)  # rkl / fkl compute in float32
    assert case["k1_noclip", 0.5] == pytest.approx(case["k2", 0.5], rel=1e-9)
    assert case["k3", 0.5] == pytest.approx(case["fkl", 0.5], rel=1e-5)
    assert case["k2", 0.5] > 1e-3 and case["k3", 0.5] > 1e-3


def test_an_id_outside_the_stale_nucleus_is_missed_by_the_sampled_token_losses():
    measured = be.unreachable_errors()
    for kind, stated in biases.UNREACHABLE_BIAS.items():
        if stated:
            assert two_digits(measured[kind]) == two_digits(stated), (kind, measured[kind])
        else:  # the full-vocabulary losses recompute the nucleus at each prefix: exact (float32)
            assert measured[kind] < 1e-6, (kind, measured[kind])


def test_the_reward_under_overlap_is_off_by_the_stated_amount():
    measured = be.reward_overlap_table(biases.SHIFTS, n_cases=5)
    for key, stated in biases.REWARD_OVERLAP_BIAS.items():
        assert two_digits(measured[key]) == two_digits(stated), (key, measured[key])
    # the harness's reference: on-policy (no shift) and a fixed token count, the identity holds exactly
    assert be.reward_overlap_error(0.0, seed=0, clip=True) < 1e-9


@pytest.mark.parametrize("baseline", ["loo", "mean"])
def test_the_reward_identity_with_a_variable_token_count_is_off_by_the_stated_amount(baseline):
    for G, stated in biases.VARIABLE_COUNT_BIAS.items():
        assert two_digits(be.variable_count_error(G, baseline=baseline)) == two_digits(stated), G


def test_the_help_and_the_docs_print_the_stated_numbers():
    from opdkit.cli import build_parser

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    docs = (ROOT / "docs" / "fidelity.md").read_text()
    for x in [*biases.OVERLAP_BIAS.values(), *biases.REWARD_OVERLAP_BIAS.values(),
              *biases.VARIABLE_COUNT_BIAS.values(), biases.UNREACHABLE_BIAS["k2"], biases.UNREACHABLE_BIAS["k3"]]:
        assert biases.pct(x) in docs, biases.pct(x)
    for x in (biases.OVERLAP_BIAS["k2", 0.15], biases.OVERLAP_BIAS["k1", 0.5], biases.VARIABLE_COUNT_BIAS[4],
              biases.REWARD_OVERLAP_BIAS[True, 0.5]):
        assert biases.pct(x) in help_text

"""How far each sampled-token loss's expected gradient is from the divergence it names, by exact
enumeration over a 6-token vocabulary, under the old and the new sampling convention.

    python bench/enumeration_bias.py [--json OUT]

Tokens are drawn from the policy the engines sample, π = softmax(z / τ) truncated to its top-p
nucleus S. "before": the engines recorded, and the update rescored, the temperature-1 untruncated
log-probs log_softmax(z) (the ratio was 1 whatever π was). "after": both are log π
(``engines.sampling.policy_logits``). The target is autograd of the named divergence at π:
KL(π || p_T) for k1 and k2; for k3 the forward KL over S, Σ_{v in S} p_T log(p_T / π) (KL(p_T || π)
at top-p 1). Relative error |E[∇loss] - ∇D| / |∇D|, on the logits z, float64; the 6-token case
of tests/test_policy.py (z = 2, 1.5, 1, 0.3, -0.5, -1.5) and the median over 200 random ones
(those whose nucleus holds more than one id).
CPU, a second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opdkit import losses  # noqa: E402
from opdkit.engines.sampling import policy_logits  # noqa: E402

THETA_6 = [2.0, 1.5, 1.0, 0.3, -0.5, -1.5]
SETTINGS = [(1.0, 1.0), (0.6, 1.0), (0.6, 0.95), (1.1, 0.95)]


def _loss(kind, logp_1_1, old_1_1, teacher_1_1):
    one = torch.ones(1, 1, dtype=torch.float64)
    if kind == "k1":
        return losses.k1_loss(logp_1_1, old_1_1, teacher_1_1, one, 1.0, 0.2, dual_clip=3.0)[0]
    return getattr(losses, f"{kind}_loss")(logp_1_1, old_1_1, teacher_1_1, one, 1.0)[0]


def rel_error(kind: str, z_V: torch.Tensor, t_V: torch.Tensor, tau: float, top_p: float, convention: str):
    """The relative error, or None when the nucleus is one id (π is a point mass: no gradient)."""
    z_V = z_V.clone().requires_grad_(True)
    pi_V = policy_logits(z_V, tau, top_p).log_softmax(-1)
    S = torch.isfinite(pi_V)
    if kind in ("k1", "k2"):
        div = (pi_V[S].exp() * (pi_V[S] - t_V[S])).sum()
    else:
        div = (t_V[S].exp() * (t_V[S] - pi_V[S])).sum()
    want_V = torch.autograd.grad(div, z_V)[0]
    got_V = torch.zeros_like(want_V)
    for v in S.nonzero()[:, 0].tolist():
        lp_V = policy_logits(z_V, tau, top_p).log_softmax(-1) if convention == "after" else z_V.log_softmax(-1)
        lp = lp_V[v].reshape(1, 1)
        loss = _loss(kind, lp, lp.detach(), t_V[v].reshape(1, 1))  # on-policy: recorded = recomputed
        got_V += pi_V[v].detach().exp() * torch.autograd.grad(loss, z_V)[0]
    return float((got_V - want_V).norm() / want_V.norm()) if int(S.sum()) > 1 else None


def _median(values) -> float:
    return statistics.median(v for v in values if v is not None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    t6 = torch.log_softmax(1.5 * torch.randn(6, generator=g, dtype=torch.float64), -1)
    rand = [(1.5 * torch.randn(6, generator=g, dtype=torch.float64),
             torch.log_softmax(1.5 * torch.randn(6, generator=g, dtype=torch.float64), -1)) for _ in range(200)]
    rows = []
    print(f"{'loss':4s} {'tau':>4s} {'top_p':>5s} | {'6-token: before':>15s} {'after':>9s} | "
          f"{'median of 200: before':>21s} {'after':>9s}")
    for kind in ("k1", "k2", "k3"):
        for tau, top_p in SETTINGS:
            z6 = torch.tensor(THETA_6, dtype=torch.float64)
            r = {"loss": kind, "temperature": tau, "top_p": top_p,
                 "six_before": rel_error(kind, z6, t6, tau, top_p, "before"),
                 "six_after": rel_error(kind, z6, t6, tau, top_p, "after"),
                 "median_before": _median(rel_error(kind, z, t, tau, top_p, "before") for z, t in rand),
                 "median_after": _median(rel_error(kind, z, t, tau, top_p, "after") for z, t in rand)}
            rows.append(r)
            print(f"{kind:4s} {tau:4.1f} {top_p:5.2f} | {r['six_before']:15.1%} {r['six_after']:9.1e} | "
                  f"{r['median_before']:21.1%} {r['median_after']:9.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The biases opdkit states for one-step-off rollouts and the reward term (opdkit/biases.py,
docs/fidelity.md), measured by exact enumeration (tests/bias_enumeration.py), beside the stated values.

    python bench/overlap_bias.py [--cases 5]

CPU, about a minute on one idle core.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import bias_enumeration as be  # noqa: E402
from opdkit import biases  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=5, help="random cases per median (the stated values: 5)")
    args = ap.parse_args(argv)
    rows = []
    ov = be.overlap_table(biases.SHIFTS, args.cases)
    for (kind, sd), v in sorted(ov.items()):
        rows.append((f"overlap {kind}, sd {sd}", v, biases.OVERLAP_BIAS.get((kind, sd))))
    for kind, v in be.unreachable_errors().items():
        rows.append((f"top-p, unreachable id, {kind}", v, biases.UNREACHABLE_BIAS.get(kind)))
    for (clip, sd), v in sorted(be.reward_overlap_table(biases.SHIFTS, args.cases).items()):
        rows.append((f"reward under overlap, {'clipped' if clip else 'unclipped'}, sd {sd}", v,
                     biases.REWARD_OVERLAP_BIAS[clip, sd]))
    for G in biases.VARIABLE_COUNT_BIAS:
        rows.append((f"reward, variable token count, G = {G}", be.variable_count_error(G),
                     biases.VARIABLE_COUNT_BIAS[G]))
    print(f"{'case':50s} {'measured':>10s} {'stated':>8s}")
    for name, v, stated in rows:
        print(f"{name:50s} {v:10.4g} {'' if stated is None else biases.pct(stated):>8s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

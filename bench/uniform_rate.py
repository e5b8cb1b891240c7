"""Point 1 of issue 14: how often the sampler's uniforms leave (0, 1) at V = 151,936.

    python bench/uniform_rate.py --rows 660 --out bench/results/uniform_rate.json

Counts, over rows x V draws (per-sample seeds, token index = row), the uniforms equal to 0 or 1
for the float32 formula the sampler used before, ``(k + 0.5) * 2**-24`` with 24 hash bits, and
for ``opdkit.engines.sampling.uniform_noise`` now; and the share of sampled tokens hit (a row with
a uniform of 1 has a Gumbel of +inf: that id wins whatever the logits say).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opdkit.engines.sampling import _GOLDEN, _mix64, _shr, sample_seed, uniform_noise  # noqa: E402

V = 151_936


def old_uniform_noise(seeds_B: torch.Tensor, t: int, V: int) -> torch.Tensor:
    key_B = _mix64(seeds_B * _GOLDEN + t)
    v_V = torch.arange(V, dtype=torch.int64)
    bits_B_V = _mix64(key_B[:, None] + v_V[None, :] * _GOLDEN)
    return (_shr(bits_B_V, 40).float() + 0.5) * (1.0 / (1 << 24))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=660)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    res = {"V": V, "rows": args.rows, "draws": args.rows * V}
    for name, fn in (("before", old_uniform_noise), ("after", uniform_noise)):
        out_of_range = rows_hit = 0
        for start in range(0, args.rows, 20):
            n = min(20, args.rows - start)
            seeds_B = torch.tensor([sample_seed(0, start + i, 0) for i in range(n)], dtype=torch.int64)
            u_B_V = fn(seeds_B, start, V)
            bad_B_V = (u_B_V <= 0) | (u_B_V >= 1)
            out_of_range += int(bad_B_V.sum())
            rows_hit += int(bad_B_V.any(1).sum())
        res[name] = {"uniforms_out_of_range": out_of_range, "rate_per_draw": out_of_range / res["draws"],
                     "sampled_tokens_hit": rows_hit, "rate_per_sampled_token": rows_hit / args.rows}
    res["expected_before_per_token"] = 1 - (1 - 2.0 ** -24) ** V  # k = 2**24 - 1 rounds to 1.0
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

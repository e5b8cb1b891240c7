"""CPU seconds of the cross-tokenizer alignment (docs/cross_tokenizer.md): building the pair of the
real Qwen2.5 tokenizer with itself (its payload tables) and one step's teacher view (re-tokenizing and
aligning B completions of T tokens), on the real-scale fixture's tokenizer.

    python -m opdkit fixture qwen2 --out /tmp/qfx
    python bench/xtok_align_speed.py /tmp/qfx [--rows 64] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from opdkit import xtok
from opdkit.fixture import problems
from opdkit.models import load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("fixture", type=Path)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    tok = load_tokenizer(a.fixture / "student")
    t0 = time.perf_counter()
    pair = xtok.make_pair(tok, tok, (151645, 151643), (151645, 151643), 151645)
    t1 = time.perf_counter()
    text = " ".join(p for p, _ in problems.TRAIN_PROBLEMS)
    ids = tok(text * (1 + 4 * a.tokens // max(len(text), 1)), add_special_tokens=False).input_ids[: a.tokens]
    comp_B_T = torch.tensor([ids] * a.rows)
    t2 = time.perf_counter()
    xb = xtok.teacher_view(pair, comp_B_T, torch.ones_like(comp_B_T, dtype=torch.float), [[1, 2, 3]] * a.rows)
    t3 = time.perf_counter()
    print(f"make_pair (Qwen2.5 x Qwen2.5, {len(pair.s_bytes):,} ids each): {t1 - t0:.2f} s; teacher_view of "
          f"{a.rows} x {len(ids)} tokens: {t3 - t2:.2f} s ({(t3 - t2) / (a.rows * len(ids)) * 1e6:.1f} us/token); "
          f"one-to-one share {xtok.span_stats(xb)['xtok_one_to_one_frac']:.3f}")


if __name__ == "__main__":
    main()

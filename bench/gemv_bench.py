"""The decode step's projections at batch 8 on one GPU: cuBLAS (``torch.nn.functional.linear``) against the
kit's GEMV kernel (``opdkit.engines.decode_kernels.gemv_launch``) at its default configuration and over a
grid of configurations, each shape as the static decoder runs it: L distinct weights (one per layer, so no
weight is re-read from L2) called back to back inside one CUDA graph, timed over its replays.

    python bench/gemv_bench.py --out /tmp/out          # the Qwen2.5-1.5B shape (hidden 1536, MLP 8960)
    python bench/gemv_bench.py --out /tmp/out --quick  # the default configuration only
    python bench/gemv_bench.py --out /tmp/out --grid tune  # the default's blocks and split over warps and stages,
                                                           # then its neighbours in block and split

Writes one JSON row per (shape, variant) to OUT/gemv.jsonl: microseconds per call, GB/s of weights streamed,
and the weights-only bound at the copy bandwidth measured in the same process; each configuration's
``same_bits_as_default``: its output equal, bit for bit, to the default configuration's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch


def time_calls(fn, layers: int, replays: int = 20) -> float:
    """Microseconds per call of ``fn(i)`` for i in 0..layers-1, captured once as a CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(layers):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * layers)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--mlp", type=int, default=8960)
    ap.add_argument("--qkv", type=int, default=2048, help="fused q/k/v outputs (12 + 2 x 2 heads of 128)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--quick", action="store_true", help="the default configuration only, no grid")
    ap.add_argument("--grid", choices=["blocks", "tune"], default="blocks",
                    help="blocks: BLOCK_N x BLOCK_K x SPLIT at 4 warps / 4 stages; tune: the default's blocks and "
                         "split at 2 / 4 / 8 warps x 2-6 stages, then BLOCK_N and SPLIT halved / doubled")
    ap.add_argument("--budget-s", type=float, default=150.0, help="the grid's seconds, shared out over the shapes")
    args = ap.parse_args(argv)
    from opd_bench import copy_bandwidth  # bench/ is this script's directory: on sys.path

    from opdkit.engines import decode_kernels as dk

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    bw = copy_bandwidth("cuda", numel=2**28, warmup=3, reps=10)  # as bench/s1_speed.py measures it
    B, H, Im, X, L = args.batch, args.hidden, args.mlp, args.qkv, args.layers
    dt = torch.bfloat16
    shapes = {  # name: (outputs N, inputs K, bias, silu)
        "qkv": (X, H, True, False), "o_proj": (H, H, False, False), "gate_up+silu": (Im, H, False, True),
        "down": (H, Im, False, False)}
    x_by_k = {k: torch.randn(B, k, dtype=dt, device="cuda") for k in (H, Im)}
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        with open(out / "gemv.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    for name, (N, K, bias, silu) in shapes.items():
        NW = 2 * N if silu else N
        ws = [torch.randn(NW, K, dtype=dt, device="cuda") / K ** 0.5 for _ in range(L)]
        bs = [torch.randn(NW, dtype=dt, device="cuda") for _ in range(L)] if bias else [None] * L
        x = x_by_k[K]
        weight_bytes = NW * K * 2
        base = dict(shape=name, N=N, K=K, batch=B, bias=bias, silu=silu, weight_bytes=weight_bytes, copy_Bps=bw,
                    bound_us=weight_bytes / bw * 1e6)

        def cublas(i, ws=ws, bs=bs, x=x, silu=silu):
            y = torch.nn.functional.linear(x, ws[i], bs[i])
            return dk.silu_mul(y) if silu else y

        us = time_calls(cublas, L)
        emit({**base, "variant": "cublas" + (" + silu_mul kernel" if silu else ""), "us": us,
              "GBps": weight_bytes / us / 1e3})
        want = cublas(0).float()
        configs, t_shape = [None], time.perf_counter()
        bn, bk, sp, *_ = dk.gemv_config(N, K)
        if args.quick:
            pass
        elif args.grid == "blocks":
            grid = itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8), (4,), (4,))
            configs += [c for c in grid if K // c[2] >= c[1]]
        else:
            configs += [(bn, bk, sp, w, st) for w in (2, 4, 8) for st in (2, 3, 4, 5, 6)]
            configs += [(n, bk, s2, w, st) for n in (bn // 2, bn, 2 * bn) for s2 in (sp // 2, sp, 2 * sp)
                        for w, st in ((4, 4), (8, 4), (8, 3)) if s2 >= 1 and n >= 16 and (n, s2) != (bn, sp)
                        and K // s2 >= bk]
        default_out, best = None, None
        for cfg in configs:
            if time.perf_counter() - t_shape > args.budget_s / len(shapes):
                emit({**base, "variant": "grid stopped: budget", "us": None})
                break
            try:
                def gemv(i, ws=ws, bs=bs, x=x, N=N, silu=silu, cfg=cfg):
                    return dk.gemv_launch(x, ws[i], bs[i], N, silu, cfg)

                got = gemv(0)
                err = float((got.float() - want).abs().max())
                if default_out is None:
                    default_out = got
                same = bool(torch.equal(got, default_out))
                us = time_calls(gemv, L)
            except Exception as e:  # a configuration Triton cannot compile here: reported, the next goes on
                emit({**base, "variant": f"gemv {cfg}", "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            used = cfg or dk.gemv_config(N, K)
            row = {**base, "variant": "gemv default" if cfg is None else "gemv", "config": list(used), "us": us,
                   "GBps": weight_bytes / us / 1e3, "max_abs_diff_vs_cublas": err, "same_bits_as_default": same}
            emit(row)
            if best is None or us < best["us"]:
                best = row
        if best is not None and len(configs) > 1:
            emit({**best, "variant": "gemv best of grid"})
    print(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

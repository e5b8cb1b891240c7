"""The update's attention at S1's shape on one GPU: forward + backward of B causal rows of n tokens (12 query / 2
key-value heads of 128, bf16), as torch's variable-length FlashAttention over the packed rows
(``torch.nn.attention.varlen.varlen_attn``, what ``opdkit.packing`` runs) against sdpa row by row with each of its
backends (cuDNN, flash). Prints one JSON line per (backend, n): milliseconds per forward and per forward + backward
(median of 5 after 2 warm-ups) and the largest |difference| of the output and of dq / dk / dv from the first's.
Equal lengths only: sdpa's cuDNN kernel builds a plan per distinct length, which a real step's rows (each of its own
length) pay row by row (S1 at 7,168 through it, 2026-12-04: update 2.38-2.47 s vs 2.19-2.23 through varlen).

    python3 bench/update_attn_bench.py --rows 8 --tokens 7400 1264
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics

import torch


def _time(fn, reps=5):
    out = []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        if i >= 2:
            out.append(s.elapsed_time(e))
    return statistics.median(out)


def bench_length(n: int, rows: int) -> None:
    """One JSON line per implementation at ``rows`` rows of ``n`` tokens."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn

    H, K, D = 12, 2, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    N = rows * n
    q = torch.randn(N, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    k = torch.randn(N, K, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    v = torch.randn(N, K, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    dout = torch.randn(N, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.arange(0, N + 1, n, device="cuda", dtype=torch.int32)
    scale = D ** -0.5

    causal = {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters else {
        "is_causal": True}  # (torch 2.11's varlen_attn takes a window; opdkit.packing asks the same way)

    def varlen():
        kr, vr = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        return varlen_attn(q, kr, vr, cu, cu, n, n, scale=scale, **causal)

    def by_rows(backend):
        def run():
            outs = []
            for b in range(rows):
                sl = slice(b * n, (b + 1) * n)
                qb = q[sl].transpose(0, 1)[None]
                kb = k[sl].transpose(0, 1).repeat_interleave(H // K, dim=0)[None]
                vb = v[sl].transpose(0, 1).repeat_interleave(H // K, dim=0)[None]
                with sdpa_kernel([backend]):
                    o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
                outs.append(o[0].transpose(0, 1))
            return torch.cat(outs)
        return run

    ref = None
    for name, fn in [("varlen", varlen), ("sdpa_cudnn", by_rows(SDPBackend.CUDNN_ATTENTION)),
                     ("sdpa_flash", by_rows(SDPBackend.FLASH_ATTENTION))]:
        row = {"what": "update_attention", "impl": name, "rows": rows, "tokens": n}

        def fwd_bwd(fn=fn):
            q.grad = k.grad = v.grad = None
            fn().backward(dout)

        try:
            with torch.no_grad():
                row["fwd_ms"] = round(_time(fn), 3)
            row["fwd_bwd_ms"] = round(_time(fwd_bwd), 3)
            out = fn().detach()
            fwd_bwd()
            got = (out, q.grad.clone(), k.grad.clone(), v.grad.clone())
            if ref is None:
                ref = got
            else:
                row["max_abs_diff"] = {w: float((a.float() - b.float()).abs().max())
                                       for w, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
        except Exception as e:  # a backend that cannot run this shape says so
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[7400, 1264])
    args = ap.parse_args()
    for n in args.tokens:
        bench_length(n, args.rows)


if __name__ == "__main__":
    main()

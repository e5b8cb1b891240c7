"""The decode step's attention at batch 8 on one GPU, at the contexts a long rollout passes through: the kit's
rotary + cache-write + flash-decoding partials kernel and its merge (``opdkit.engines.decode_kernels.
rope_attention``) over launch settings, blocks and split counts, against the same kernel of another kit copy
(``--before``: its ``opdkit/engines/decode_triton.py``, launched as that kit launched it), each as the static
decoder runs it: L distinct caches (one per layer, so nothing is re-read from L2) called back to back inside one
CUDA graph.

    python bench/attn_bench.py --out /tmp/out --before .speed/head/opdkit/engines/decode_triton.py
    python bench/attn_bench.py --out /tmp/out --device cpu   # a dry run of the code paths (Triton's interpreter)

Writes one JSON row per (capacity, context, variant) to OUT/attn.jsonl: microseconds per call (partials + merge),
GB/s of visible K/V read, the K/V-only bound at the copy bandwidth measured in the same process, and whether the
output and the caches are the same bits as the first variant's (``before`` when given, else the default plan).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--before", default="", help="another kit's opdkit/engines/decode_triton.py (the 'before')")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--capacities", default="1264,3312,7408", help="cache slots (prompt + new tokens + 16)")
    ap.add_argument("--contexts", default="256,1024,2048,4096,7168", help="visible slots (those <= the capacity)")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--programs", default="", help="instead of the default grid: the default plan, then each of these "
                    "program counts (e.g. 128,64) at blocks of 32 and 64 slots and 3 and 4 stages")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gemv_bench import time_calls
    from opd_bench import copy_bandwidth

    from opdkit.engines import decode_kernels as dk

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dev = args.device
    dt = torch.float32 if cpu else torch.bfloat16  # the interpreter's bf16 rounding is not the GPU's
    B, H, K, D, L = args.batch, args.heads, args.kv_heads, args.head_dim, args.layers
    if cpu:
        B, H, K, D, L = 2, 4, 2, 32, 2
    bw = None if cpu else copy_bandwidth(dev, numel=2**28, warmup=3, reps=10)
    before = None
    if args.before and Path(args.before).is_file():
        spec = importlib.util.spec_from_file_location("decode_triton_before", args.before)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)

    def launch_before(plan, qkv, cos, sin, pos, kc, vc, start, end_1, end_offset):
        G = H // K
        sb, sk, sl, _ = kc.stride()
        before.rope_attn_partial_kernel[(B, K, plan.nsplit)](
            qkv, cos, sin, pos, kc, vc, start, end_1, end_offset, plan.acc, plan.m, plan.l, D ** -0.5, qkv.stride(0),
            sb, sk, sl, H=H, K=K, G=G, GP=max(16, dk._next_pow2(G)), D=D, CHUNK=plan.chunk, BLOCK_N=plan.BLOCK_N,
            NSPLIT=plan.nsplit, IEEE=qkv.dtype == torch.float32, STATIC_LOOP=cpu, PDL=False)
        o = torch.empty((B, H, D), dtype=qkv.dtype, device=qkv.device)
        before.attn_reduce_kernel[(B * H,)](plan.acc, plan.m, plan.l, o, NSPLIT=plan.nsplit,
                                            NSP=dk._next_pow2(plan.nsplit), D=D, PDL=False)
        return o

    variants = ([("before", dict(), launch_before)] if before is not None else []) + [("new", dict(), None)] + [
        (f"new block={bn} stages={st}", dict(block_n=bn, num_stages=st), None)
        for bn in (64, 32) for st in (2, 3, 4) if (bn, st) != (64, 3)] + [
        (f"new block=32 stages=3 programs={p}", dict(block_n=32, num_stages=3, programs=p), None) for p in (256, 1024)]
    if args.programs:  # the split count's grid: fewer programs read more blocks each and leave fewer partials to merge
        variants = [("new", dict(), None)] + [
            (f"new block={bn} stages={st} programs={p}", dict(block_n=bn, num_stages=st, programs=p), None)
            for p in (int(x) for x in args.programs.split(",")) for bn in (32, 64) for st in (3, 4)]
    if cpu:
        variants = variants[:2] + [v for v in variants if v[0] == "new block=32 stages=3 programs=1024"]

    def emit(row: dict) -> None:
        with open(out / "attn.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    def make_call(plan, fn, caches, qkvs, rope, start, end_1):
        """fn(i, cs=None): layer i's attention (its cache, or ``cs`` = (k, v)); the new token at slot end - 1."""
        cos, sin, pos = rope

        def call(i, cs=None):
            kc, vc = caches[i] if cs is None else cs
            if fn is not None:
                return fn(plan, qkvs[i], cos, sin, pos, kc, vc, start, end_1, 100)
            return dk.rope_attention(qkvs[i], cos, sin, pos, kc, vc, start, end_1, D ** -0.5, plan, H, K,
                                     end_offset=100)
        return call

    torch.manual_seed(0)
    for cap in (int(c) for c in args.capacities.split(",")):
        if cpu:
            cap = min(cap, 300)
        caches = [(torch.randn(B, K, cap, D, device=dev).to(dt), torch.randn(B, K, cap, D, device=dev).to(dt))
                  for _ in range(L)]
        qkvs = [torch.randn(B, (H + 2 * K) * D, device=dev).to(dt) for _ in range(L)]
        ang = torch.randn(cap, D // 2, device=dev)
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)
        start = torch.zeros(B, dtype=torch.int64, device=dev)
        for ctx in sorted({min(int(c), cap - 16) for c in args.contexts.split(",")}):
            if cpu:
                ctx = min(ctx, 200)
            pos = torch.full((B,), ctx - 1, dtype=torch.int64, device=dev)
            end_1 = torch.tensor([ctx - 100], dtype=torch.int64, device=dev)  # + end_offset 100: end = ctx
            base = dict(batch=B, H=H, K=K, D=D, layers=L, capacity=cap, context=ctx, copy_Bps=bw)
            kv_bytes = B * K * ctx * D * 2 * caches[0][0].element_size()
            base["kv_bytes"] = kv_bytes
            if bw:
                base["bound_us"] = kv_bytes / bw * 1e6
            ref = None
            for name, kw, fn in variants:
                if time.perf_counter() - t0 > args.budget_s:
                    emit({**base, "variant": "stopped: budget"})
                    return 0
                try:
                    plan = dk.AttentionPlan(B, H, K, D, cap, dev, **kw)
                    work = [(kc.clone(), vc.clone()) for kc, vc in caches[:1]]

                    call = make_call(plan, fn, caches, qkvs, (cos, sin, pos), start, end_1)
                    o = call(0, cs=work[0])
                    bits = (o, work[0][0], work[0][1])
                    same = None if ref is None else all(torch.equal(a, b) for a, b in zip(bits, ref))
                    if ref is None:
                        ref = bits
                    row = {**base, "variant": name, "nsplit": plan.nsplit, "chunk": plan.chunk,
                           "same_bits_as_first": same}
                    if not cpu:
                        us = time_calls(call, L)
                        row.update(us=us, GBps=kv_bytes / us / 1e3)
                    else:
                        want = dk.rope_attention_ref(qkvs[0], cos, sin, pos, caches[0][0].clone(),
                                                     caches[0][1].clone(), start, ctx, D ** -0.5, H, K)
                        row["max_abs_diff_vs_ref"] = float((want - o).abs().max())
                    emit(row)
                except Exception as e:  # reported, the next goes on
                    emit({**base, "variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        caches.clear()
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

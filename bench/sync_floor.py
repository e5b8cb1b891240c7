"""What a dependent step between two phases of the decoder costs on one GPU, apart from the work: NPH phases (224
by default: 28 layers x the decoder's 8 kernels a layer), each of P programs reading a chunk another program of the
phase before wrote, either as NPH kernels launched back to back in one CUDA graph (with or without programmatic
dependent launch, as the decoder launches its kernels) or as one persistent kernel of P programs whose phases wait on
a grid-wide counter (an atomic arrival after each phase's stores, an acquire spin before the next phase's loads).
With ``--weights`` each program also streams a slice of weights each phase (the bytes of a phase spread over its P
programs, 28 distinct sets so nothing stays in L2), its first block loaded before the wait as the decoder's GEMV
does: what the wait costs when there is memory traffic to hide behind it.

    python bench/sync_floor.py --out /tmp/out                # on the GPU
    python bench/sync_floor.py --out /tmp/out --device cpu   # a dry run of the code paths (Triton's interpreter)

Writes one JSON row per (variant, programs, weight bytes a phase) to OUT/sync.jsonl: microseconds per phase (median
of ``--repeats`` timed replays of the graph; each replay also copies the first chunks in and, for the persistent
kernel, zeroes the counter: two small launches spread over the NPH phases), and whether every chunk holds what the
NPH phases must leave in it (a lost wait shows there as a wrong chunk). The persistent kernel needs all its P
programs resident at once: P is at most the multiprocessors times the programs that fit on one, and its waits give
up after ``--max-spin`` polls in all (the row then says ``correct: false`` rather than hanging the GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path


def _run(name, pdl, chain, persistent, bufs, init, w, w_set, sink, ctr, flag, P, NPH, NSETS, max_spin, CH, WBLK, nwb):
    """One timed unit: the first chunks, then the NPH phases as kernels or as the persistent kernel."""
    bufs[0].copy_(init)
    if name.startswith("kernels"):
        extra = dict(launch_pdl=True) if pdl else {}
        for i in range(NPH):
            chain[(P,)](bufs[i % 2], bufs[(i + 1) % 2], w[(i % NSETS) * w_set:], sink, P, CH=CH, WBLK=WBLK, NWB=nwb,
                        PDL=bool(pdl), **extra)
    else:
        ctr.zero_()
        persistent[(P,)](bufs, w, sink, ctr, flag, P, NPH, w_set, NSETS, max_spin, CH=CH, WBLK=WBLK, NWB=nwb,
                         SYNC=name == "persistent")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--phases", type=int, default=224)
    ap.add_argument("--programs", default="132,264")
    ap.add_argument("--weights", default="0,6291456", help="weight bytes a phase (6,291,456: the fused q/k/v's)")
    ap.add_argument("--chunk", type=int, default=256, help="float32 values a program reads and writes a phase")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--max-spin", type=int, default=1 << 20, help="polls a program may spend waiting in one launch")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sync_floor_kernels import chain_kernel as chain, persistent_kernel as persistent

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev, NPH, CH, WBLK, NSETS = args.device, args.phases, args.chunk, 4096, 28
    pdl_ok = not cpu and torch.cuda.get_device_capability()[0] >= 9
    rows = []
    for P in [int(v) for v in args.programs.split(",")]:
        for wbytes in [int(v) for v in args.weights.split(",")]:
            nwb = -(-wbytes // (2 * WBLK * P)) if wbytes else 0  # blocks a program streams a phase
            w_set = max(1, P * nwb * WBLK)
            w = torch.randn(NSETS * w_set, device=dev).to(torch.bfloat16 if not cpu else torch.float32)
            sink = torch.zeros(P, device=dev)
            init = torch.randint(-1000, 1000, (P, CH), device=dev).float()  # sums exact in float32
            want = init.roll(-NPH, 0) + NPH  # chunk p: the first chunk (p + NPH) % P, plus one a phase
            variants = [("kernels_pdl", True), ("kernels", False)] if pdl_ok else [("kernels", False)]
            variants += [("persistent", None), ("persistent_nosync", None)]
            for name, pdl in variants:
                if name.startswith("persistent") and cpu and P > 1:
                    continue  # the interpreter runs programs one after another: a grid-wide wait never ends
                bufs = torch.empty(2, P, CH, device=dev)
                ctr = torch.zeros(1, dtype=torch.int32, device=dev)
                flag = torch.zeros(1, dtype=torch.int32, device=dev)

                run = functools.partial(_run, name, pdl, chain, persistent, bufs, init, w, w_set, sink, ctr, flag, P,
                                        NPH, NSETS, args.max_spin, CH, WBLK, nwb)
                run()
                if cpu or int(flag.item()):  # no timing where a wait gave up
                    us = float("nan")
                else:
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        run()
                    g.replay()
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(args.repeats):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        g.replay()
                        b.record()
                        torch.cuda.synchronize()
                        times.append(a.elapsed_time(b) * 1e3 / NPH)
                    us = sorted(times)[len(times) // 2]
                correct = bool(torch.equal(bufs[NPH % 2], want)) and int(flag.item()) == 0
                row = dict(variant=name, programs=P, weight_bytes_a_phase=P * nwb * WBLK * 2, phases=NPH,
                           us_a_phase=round(us, 3), correct=correct, spin_gave_up=int(flag.item()),
                           device=torch.cuda.get_device_name() if not cpu else "cpu")
                print(json.dumps(row), flush=True)
                rows.append(row)
    with open(out / "sync.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"sync_floor: {time.perf_counter() - t0:.1f} s")
    raise SystemExit(rc)

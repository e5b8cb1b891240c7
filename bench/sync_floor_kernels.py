"""The Triton kernels of ``bench/sync_floor.py`` (imported once the interpreter is set or not)."""

import triton
import triton.language as tl


@triton.jit
def _stream(w_ptr, base, w0, WBLK: tl.constexpr, NWB: tl.constexpr):
    """The float32 sum of NWB blocks of WBLK weights from ``base`` (the first, ``w0``, already loaded)."""
    acc = tl.sum(w0.to(tl.float32), 0)
    for j in range(1, NWB):
        acc += tl.sum(tl.load(w_ptr + base + j * WBLK + tl.arange(0, WBLK)).to(tl.float32), 0)
    return acc

@triton.jit
def chain_kernel(src_ptr, dst_ptr, w_ptr, sink_ptr, P, CH: tl.constexpr, WBLK: tl.constexpr,
                 NWB: tl.constexpr, PDL: tl.constexpr):
    """One phase: program p writes chunk p of dst = chunk (p + 1) % P of src + 1 (and its weights' sum to the
    sink), its first block of weights loaded before the PDL wait."""
    p = tl.program_id(0)
    base = p * NWB * WBLK
    if NWB > 0:
        w0 = tl.load(w_ptr + base + tl.arange(0, WBLK))
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if NWB > 0:
        tl.store(sink_ptr + p, _stream(w_ptr, base, w0, WBLK, NWB))
    c = tl.arange(0, CH)
    x = tl.load(src_ptr + ((p + 1) % P) * CH + c, cache_modifier=".cg")
    tl.store(dst_ptr + p * CH + c, x + 1.0)

@triton.jit
def persistent_kernel(buf_ptr, w_ptr, sink_ptr, ctr_ptr, flag_ptr, P, NPH, W_SET, NSETS, MAX_SPIN,
                      CH: tl.constexpr, WBLK: tl.constexpr, NWB: tl.constexpr, SYNC: tl.constexpr):
    """The NPH phases of ``chain_kernel`` in one launch, ping-ponging between the two halves of ``buf``; before
    phase i's loads every program waits until the counter holds i x P arrivals (SYNC False: no wait, the work
    alone, wrong chunks). A program whose polls reach MAX_SPIN in all stops waiting and sets the flag."""
    p = tl.program_id(0)
    c = tl.arange(0, CH)
    base = p * NWB * WBLK
    spins = 0  # over all phases: after MAX_SPIN polls in all, the waits give up (a grid not all resident ends)
    for i in range(NPH):
        src = buf_ptr + (i % 2) * P * CH
        dst = buf_ptr + ((i + 1) % 2) * P * CH
        wp = w_ptr + (i % NSETS) * W_SET
        if NWB > 0:
            w0 = tl.load(wp + base + tl.arange(0, WBLK))
        if SYNC:
            target = i * P
            seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
            while (seen < target) & (spins < MAX_SPIN):
                seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
                spins += 1
            if seen < target:
                tl.store(flag_ptr, 1)
            tl.debug_barrier()
        if NWB > 0:
            tl.store(sink_ptr + p, _stream(wp, base, w0, WBLK, NWB))
        x = tl.load(src + ((p + 1) % P) * CH + c, cache_modifier=".cg")
        tl.store(dst + p * CH + c, x + 1.0)
        if SYNC:
            tl.debug_barrier()  # every thread's stores before the one arrival
            tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")

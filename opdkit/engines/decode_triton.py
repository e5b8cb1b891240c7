"""The Triton kernels behind ``engines.decode_kernels`` (imported only when they run: this module
imports Triton). Each kernel's semantics is its reference in ``decode_kernels``; shapes as there."""

import triton
import triton.language as tl


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """Programmatic dependent launch (Hopper and later; the kernel launched with ``launch_pdl``): wait until every
    write of the kernel before is visible, then let the kernel after launch (its programs wait likewise before they
    read anything), so its launch overlaps this kernel's work. Every kernel here calls it before its first store and
    before it loads anything an earlier kernel of the step writes (the GEMV loads a first block of weights before),
    so the results are those of the kernels run one after the other. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``tl.dot(a, b)``; with IEEE (float32 inputs, the CPU tests' precision) in full float32, not TF32."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _rotate(x, partner, cos, sin, d, half: tl.constexpr):
    """HF's ``x * cos + rotate_half(x) * sin`` in float32 (``partner``: x at d + D/2 mod D), as ``rotate`` does."""
    rot = tl.where(d < half, -partner, partner)
    return x * cos + rot * sin


@triton.jit
def _attn_block(q, k_ptr, v_ptr, base, n0, lo, hi, stride_cl, d, m_i, l_i, acc, scale, BLOCK_N: tl.constexpr,
                IEEE: tl.constexpr):
    """One block of BLOCK_N cache slots from ``n0`` (those in [lo, hi) visible) folded into the online softmax
    (m_i, l_i, acc) of the rotated queries ``q`` (GP, D): flash decoding's inner step."""
    n = n0 + tl.arange(0, BLOCK_N)
    valid = (n >= lo) & (n < hi)
    kv_off = base + n[:, None] * stride_cl + d[None, :]
    k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0)
    sc = _dot(q, tl.trans(k), IEEE)
    sc = tl.where(valid[None, :], sc * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))  # finite: the block holds a visible slot
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def rope_attn_partial_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, start_ptr, end_ptr, end_offset, acc_ptr,
                             m_ptr, l_ptr, scale, stride_qkv, stride_cb, stride_ck, stride_cl,
                             H: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                             CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr,
                             IEEE: tl.constexpr, STATIC_LOOP: tl.constexpr, PDL: tl.constexpr):
    """Program (b, kh, s): the G query heads of K/V head kh of row b rotated at the row's position (from the raw
    q/k/v projection), the split holding the new token's slot (end - 1) writing its rotated k and its v into the
    caches, then flash-decoding partials over the visible slots of split s (a split with none writes m = -inf and
    l = 0 only: ``attn_reduce_kernel`` gives it weight 0 without reading its partials). The splits share the
    slots [0, end) of this step, whole blocks of BLOCK_N each (``chunk`` <= CHUNK, the split at the capacity), so
    every split has work at every context, not only once the rollout has filled the cache."""
    _pdl_enter(PDL)
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(start_ptr + b)
    end = tl.load(end_ptr) + end_offset
    chunk = tl.cdiv(tl.cdiv(end, NSPLIT), BLOCK_N) * BLOCK_N  # this step's slots per split, whole blocks
    lo = tl.maximum(start, s * chunk)
    hi = tl.minimum(end, s * chunk + chunk)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    gmask = g < G
    half: tl.constexpr = D // 2
    dp = (d + half) % D
    pos = tl.load(pos_ptr + b)
    cos = tl.load(cos_ptr + pos * D + d).to(tl.float32)
    sin = tl.load(sin_ptr + pos * D + d).to(tl.float32)
    row = qkv_ptr + b * stride_qkv
    slot = end - 1
    if (slot >= s * chunk) & (slot < s * chunk + chunk):  # this split reads the new slot: it writes it first
        krow = row + (H + kh) * D
        k_new = _rotate(tl.load(krow + d).to(tl.float32), tl.load(krow + dp).to(tl.float32), cos, sin, d, half)
        at = b * stride_cb + kh * stride_ck + slot * stride_cl + d
        tl.store(k_ptr + at, k_new.to(k_ptr.dtype.element_ty))
        tl.store(v_ptr + at, tl.load(row + (H + K + kh) * D + d).to(v_ptr.dtype.element_ty))
    tl.debug_barrier()  # the block's stores visible to all its threads before the loop reads the slot
    h = kh * G + g
    part = (b * (K * G) + h) * NSPLIT + s
    if lo < hi:  # the split holds visible slots
        qh = kh * G + g
        xq = tl.load(row + qh[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
        pq = tl.load(row + qh[:, None] * D + dp[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
        q = _rotate(xq, pq, cos[None, :], sin[None, :], d[None, :], half).to(k_ptr.dtype.element_ty)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        base = b * stride_cb + kh * stride_ck
        i_lo = (lo - s * chunk) // BLOCK_N  # the split's blocks holding a visible slot, in order
        i_hi = (hi - s * chunk + BLOCK_N - 1) // BLOCK_N
        if STATIC_LOOP:  # Triton's interpreter (some versions take no runtime loop bounds): the same blocks, in order
            for i in range(0, CHUNK // BLOCK_N):
                if (i >= i_lo) & (i < i_hi):
                    m_i, l_i, acc = _attn_block(q, k_ptr, v_ptr, base, s * chunk + i * BLOCK_N, lo, hi, stride_cl, d,
                                                m_i, l_i, acc, scale, BLOCK_N, IEEE)
        else:
            for i in range(i_lo, i_hi):  # runtime bounds: no branch in the body, so the loads pipeline (num_stages)
                m_i, l_i, acc = _attn_block(q, k_ptr, v_ptr, base, s * chunk + i * BLOCK_N, lo, hi, stride_cl, d,
                                            m_i, l_i, acc, scale, BLOCK_N, IEEE)
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=gmask[:, None])
        tl.store(m_ptr + part, m_i, mask=gmask)
        tl.store(l_ptr + part, l_i, mask=gmask)
    else:  # no visible slot: m = -inf and l = 0 only (the merge gives the split weight 0 and skips its partials)
        tl.store(m_ptr + part, tl.full([GP], float("-inf"), tl.float32), mask=gmask)
        tl.store(l_ptr + part, tl.zeros([GP], tl.float32), mask=gmask)


@triton.jit
def attn_reduce_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, NSPLIT: tl.constexpr, NSP: tl.constexpr,
                       D: tl.constexpr, PDL: tl.constexpr):
    """Program bh = b * H + h: query head bh's NSPLIT splits' partials (acc, m, l) merged into the attention output
    (D,), rounded to out's dtype; the splits with no visible slot (m = -inf) get weight 0 and are not read."""
    _pdl_enter(PDL)
    bh = tl.program_id(0)  # b * H + h
    s = tl.arange(0, NSP)
    d = tl.arange(0, D)
    valid = s < NSPLIT
    m = tl.load(m_ptr + bh * NSPLIT + s, mask=valid, other=float("-inf"))
    lsum = tl.load(l_ptr + bh * NSPLIT + s, mask=valid, other=0.0)
    mx = tl.max(m, 0)
    used = valid & (m > float("-inf"))  # the partials of splits with visible slots (the others are not written)
    w = tl.where(used, tl.exp(m - mx), 0.0)
    acc = tl.load(acc_ptr + (bh * NSPLIT + s[:, None]) * D + d[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * lsum, 0)
    tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    b = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < inter
    gate = tl.load(gu_ptr + b * stride_gu + i, mask=m, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + b * stride_gu + inter + i, mask=m, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + b * inter + i, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=m)

@triton.jit
def _mix64(z):  # engines.sampling._mix64 on uint64 (logical shifts, products modulo 2**64)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)

@triton.jit
def _order_key(raw):
    """The sort key (int32 in [0, 65536)) of finite 16-bit float logits ``raw`` (bfloat16 or float16) from their
    bits: larger for a larger value, equal for equal values (-0 as +0)."""
    bits = raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    bits = tl.where(bits == 0x8000, 0, bits)  # -0 -> +0
    return tl.where(bits >= 0x8000, 0xFFFF - bits, bits + 0x8000)  # negative: the larger the magnitude, the lower


@triton.jit
def _z64(x, tau_ptr, TEMPERED: tl.constexpr):
    """z = x / τ in float64 (float64 τ at ``tau_ptr``), as ``policy_logits`` divides the float64 logits."""
    z = x.to(tl.float32).to(tl.float64)
    if TEMPERED:
        z = z / tl.load(tau_ptr)
    return z


@triton.jit
def _key_z(key, tau_ptr, dtype, TEMPERED: tl.constexpr):
    """``_z64`` of the 16-bit float (``dtype``) whose sort key is ``key`` (``_order_key``'s inverse)."""
    bits = tl.where(key >= 0x8000, key - 0x8000, 0xFFFF - key)
    bits = tl.where(bits >= 0x8000, bits - 0x10000, bits)  # as a signed 16-bit integer
    return _z64(bits.to(tl.int16).to(dtype, bitcast=True), tau_ptr, TEMPERED)


@triton.jit
def _row_block(raw_ptr, stride_raw, n_vocab, BLOCK: tl.constexpr):
    """Program (b, j)'s block of logits: (b, j, the ids v, v < n_vocab, the logits at v in their dtype; 0 past
    n_vocab)."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    v = j * BLOCK + tl.arange(0, BLOCK)
    valid = v < n_vocab
    return b, j, v, valid, tl.load(raw_ptr + b * stride_raw + v, mask=valid, other=0.0)


@triton.jit
def nucleus_hist_kernel(raw_ptr, tau_ptr, hist_ptr, bmax_ptr, n_vocab, stride_raw, NBLK: tl.constexpr,
                        BLOCK: tl.constexpr, TEMPERED: tl.constexpr, PDL: tl.constexpr):
    """Block j of row b's logits (16-bit floats): each id counted into the row's histogram of sort keys (``hist``
    (B, 65536) int32, zero before), and the block's largest z (``bmax``)."""
    _pdl_enter(PDL)
    b, j, v, valid, raw = _row_block(raw_ptr, stride_raw, n_vocab, BLOCK)
    tl.atomic_add(hist_ptr + b * 65536 + _order_key(raw), 1, mask=valid, sem="relaxed")
    z = _z64(raw, tau_ptr, TEMPERED)
    tl.store(bmax_ptr + b * NBLK + j, tl.max(tl.where(valid, z, float("-inf")), 0))


@triton.jit
def nucleus_mass_kernel(raw_ptr, tau_ptr, hist_ptr, bmax_ptr, cmass_ptr, ccnt_ptr, NBLK: tl.constexpr,
                        NBP: tl.constexpr, CH: tl.constexpr, TEMPERED: tl.constexpr, PDL: tl.constexpr):
    """Chunk c (sort keys c CH .. c CH + CH - 1) of row b's histogram: its float64 mass sum(count exp(z - M)) (M the
    row's largest z) and its count (``cmass``, ``ccnt``: (B, 65536 / CH))."""
    _pdl_enter(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    jj = tl.arange(0, NBP)
    M = tl.max(tl.load(bmax_ptr + b * NBLK + jj, mask=jj < NBLK, other=float("-inf")), 0)
    key = c * CH + tl.arange(0, CH)
    cnt = tl.load(hist_ptr + b * 65536 + key)
    z = _key_z(key, tau_ptr, raw_ptr.dtype.element_ty, TEMPERED)
    w = tl.where(cnt > 0, cnt.to(tl.float64) * tl.exp(tl.where(cnt > 0, z, M) - M), 0.0)
    tl.store(cmass_ptr + b * (65536 // CH) + c, tl.sum(w, 0))
    tl.store(ccnt_ptr + b * (65536 // CH) + c, tl.sum(cnt, 0))


@triton.jit
def nucleus_pick_kernel(raw_ptr, tau_ptr, p_ptr, hist_ptr, bmax_ptr, cmass_ptr, ccnt_ptr, skey_ptr, NBLK: tl.constexpr,
                        NBP: tl.constexpr, CH: tl.constexpr, TEMPERED: tl.constexpr, PDL: tl.constexpr):
    """Row b's nucleus (``engines.sampling.top_p_filter``): the ids of sort keys above k and the first n of key k in
    id order, k the lowest key whose ids are not all outside it (the mass of the keys above it below p Z, Z the sum
    of exp(z - M)) and n = ceil((p Z - that mass) / exp(z_k - M)) (the ids i = 0, 1, .. of key k whose mass before
    them stays below p Z). Stores (k, n) in ``skey`` (B, 2). The masses are float64 sums in another order than
    torch's cumulative sum: the same nucleus except where the mass before an id is within float64 rounding of p Z."""
    _pdl_enter(PDL)
    b = tl.program_id(0)
    NCH: tl.constexpr = 65536 // CH
    jj = tl.arange(0, NBP)
    M = tl.max(tl.load(bmax_ptr + b * NBLK + jj, mask=jj < NBLK, other=float("-inf")), 0)
    ci = tl.arange(0, NCH)
    cm = tl.load(cmass_ptr + b * NCH + ci)
    pz = tl.load(p_ptr) * tl.sum(cm, 0)
    above_c = tl.cumsum(cm, 0, reverse=True) - cm  # the mass of the chunks above each chunk
    c = tl.min(tl.where((tl.load(ccnt_ptr + b * NCH + ci) > 0) & (above_c < pz), ci, NCH), 0)
    key = c * CH + tl.arange(0, CH)
    cnt = tl.load(hist_ptr + b * 65536 + key)
    z = _key_z(key, tau_ptr, raw_ptr.dtype.element_ty, TEMPERED)
    e = tl.exp(tl.where(cnt > 0, z, M) - M)  # one id's mass, for each key of the chunk
    w = tl.where(cnt > 0, cnt.to(tl.float64) * e, 0.0)
    above = tl.sum(tl.where(ci == c, above_c, 0.0), 0) + tl.cumsum(w, 0, reverse=True) - w
    ok = (cnt > 0) & (above < pz)
    kstar = tl.min(tl.where(ok, key, 65536), 0)
    at = key == kstar
    q = tl.sum(tl.where(at, (pz - above) / e, 0.0), 0)
    q = tl.minimum(q, tl.sum(tl.where(at, cnt, 0), 0).to(tl.float64))
    n_in = q.to(tl.int64)
    n_in = tl.maximum(tl.where(n_in.to(tl.float64) < q, n_in + 1, n_in), 1)  # ceil: the ids below q
    tl.store(skey_ptr + b * 2, kstar.to(tl.int64))
    tl.store(skey_ptr + b * 2 + 1, n_in)


@triton.jit
def nucleus_ties_kernel(raw_ptr, skey_ptr, ties_ptr, n_vocab, stride_raw, NBLK: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    """Block j of row b: how many of its ids have the sort key k of ``nucleus_pick_kernel`` (``ties`` (B, NBLK))."""
    _pdl_enter(PDL)
    b, j, v, valid, raw = _row_block(raw_ptr, stride_raw, n_vocab, BLOCK)
    hit = valid & (_order_key(raw) == tl.load(skey_ptr + b * 2).to(tl.int32))
    tl.store(ties_ptr + b * NBLK + j, tl.sum(hit.to(tl.int32), 0))


@triton.jit
def gumbel_kernel(raw_ptr, seeds_ptr, t_ptr, tau_ptr, val_ptr, idx_ptr, m_ptr, s_ptr, n_vocab, stride_raw, inv_tau,
                  skey_ptr, ties_ptr, NBLK: tl.constexpr, BLOCK: tl.constexpr, TEMPERED: tl.constexpr,
                  NUCLEUS: tl.constexpr, NBP: tl.constexpr, PDL: tl.constexpr):
    """One block of BLOCK ids of row b: the largest float64 ``raw / τ + Gumbel`` and its id (``val``, ``idx``), and
    the block's part of the float32 log-softmax of ``raw * (1 / τ)`` (``m``: its largest value, ``s``: the sum of
    ``exp(z - m)``), over the ids below n_vocab. ``raw`` float32 or bfloat16 (read as its exact float values).
    NUCLEUS (top-p < 1, 16-bit float logits, after ``nucleus_pick_kernel`` and ``nucleus_ties_kernel``; ``skey``,
    ``ties`` unread without it): over the ids of the nucleus only: those of sort keys above k and the first n of
    key k in id order."""
    _pdl_enter(PDL)
    b, j, v, valid, raw_x = _row_block(raw_ptr, stride_raw, n_vocab, BLOCK)
    raw = raw_x.to(tl.float32)
    keep = valid
    if NUCLEUS:
        kstar = tl.load(skey_ptr + b * 2).to(tl.int32)
        okey = _order_key(raw_x)
        tie = valid & (okey == kstar)
        jj = tl.arange(0, NBP)
        before = tl.sum(tl.load(ties_ptr + b * NBLK + jj, mask=jj < j, other=0), 0)  # key k's ids in earlier blocks
        rank = before + tl.cumsum(tie.to(tl.int32), 0) - 1  # among the ids of key k
        keep = valid & ((okey > kstar) | (tie & (rank < tl.load(skey_ptr + b * 2 + 1))))
    z = _z64(raw, tau_ptr, TEMPERED)
    z32 = raw
    if TEMPERED:
        z32 = raw * inv_tau  # as torch divides a CUDA float32 tensor by a Python float: times its float32 reciprocal
    seed = tl.load(seeds_ptr + b).to(tl.uint64)
    t = tl.load(t_ptr).to(tl.uint64)
    key = _mix64(seed * 0x9E3779B97F4A7C15 + t)  # uniform_noise: one stream per (row, token index)
    bits = _mix64(key + v.to(tl.uint64) * 0x9E3779B97F4A7C15)
    u = ((bits >> 12).to(tl.float64) + 0.5) * 2.220446049250313e-16  # (k + 1/2) 2**-52, k the top 52 bits
    gum = -tl.log(-tl.log(u))
    score = tl.where(keep, z + gum, float("-inf"))
    best = tl.max(score, 0)
    at = tl.argmax(score, 0)
    tl.store(val_ptr + b * NBLK + j, best)
    tl.store(idx_ptr + b * NBLK + j, (j * BLOCK + at).to(tl.int64))
    z32 = tl.where(keep, z32, float("-inf"))
    m = tl.max(z32, 0)
    tl.store(m_ptr + b * NBLK + j, m)
    tl.store(s_ptr + b * NBLK + j, tl.sum(tl.where(keep, tl.exp(z32 - m), 0.0), 0))


@triton.jit
def sample_finish_kernel(raw_ptr, val_ptr, idx_ptr, m_ptr, s_ptr, t_ptr, eos_ptr, n_eos, ids_ptr, logp_ptr, tok_ptr,
                         pos_ptr, done_ptr, stride_raw, stride_out, inv_tau, NBLK: tl.constexpr, NBP: tl.constexpr,
                         NEP: tl.constexpr, TEMPERED: tl.constexpr, PDL: tl.constexpr):
    """Row b's sampled id from ``gumbel_kernel``'s blocks (the first block holding the largest score, as an argmax
    over them picks) and its float32 log-softmax ``(z - M) - log(S)`` (M the largest z, S the sum of exp(z - M)
    merged from the blocks): written at token index t of the outputs, as the next input token, the row's position
    advanced by one and its done flag set where the id is one of the n_eos end ids."""
    _pdl_enter(PDL)
    b = tl.program_id(0)
    j = tl.arange(0, NBP)
    jm = j < NBLK
    val = tl.load(val_ptr + b * NBLK + j, mask=jm, other=float("-inf"))
    best = tl.argmax(val, 0)
    new = tl.load(idx_ptr + b * NBLK + best)
    m = tl.load(m_ptr + b * NBLK + j, mask=jm, other=float("-inf"))
    mx = tl.max(m, 0)
    total = tl.sum(tl.where(jm, tl.load(s_ptr + b * NBLK + j, mask=jm, other=0.0) * tl.exp(m - mx), 0.0), 0)
    z = tl.load(raw_ptr + b * stride_raw + new).to(tl.float32)
    if TEMPERED:
        z = z * inv_tau
    t = tl.load(t_ptr)
    tl.store(ids_ptr + b * stride_out + t, new)
    tl.store(logp_ptr + b * stride_out + t, (z - mx) - tl.log(total))
    tl.store(tok_ptr + b, new)
    tl.store(pos_ptr + b, tl.load(pos_ptr + b) + 1)
    e = tl.arange(0, NEP)
    eos = tl.load(eos_ptr + e, mask=e < n_eos, other=-1)
    hit = tl.max((eos == new).to(tl.int32), 0)
    tl.store(done_ptr + b, tl.maximum(tl.load(done_ptr + b).to(tl.int32), hit).to(tl.uint8))


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, eps, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _pdl_enter(PDL)
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(x_ptr + b * stride_x + i, mask=m, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / N
    y = (x * (1.0 / tl.sqrt_rn(var + eps))).to(out_ptr.dtype.element_ty)  # rounded, then scaled (HF's order)
    w = tl.load(w_ptr + i, mask=m, other=0.0)
    tl.store(out_ptr + b * N + i, (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def add_rms_norm_kernel(h_ptr, r_ptr, w_ptr, out_ptr, N, eps, stride_h, stride_r, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    _pdl_enter(PDL)
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < N
    r = tl.load(r_ptr + b * stride_r + i, mask=m, other=0.0)
    _add_rms_norm_row(h_ptr + b * stride_h, r, w_ptr, out_ptr + b * N, i, m, N, eps)


@triton.jit
def _add_rms_norm_row(h_row, r, w_ptr, out_row, i, m, N, eps):
    """One row of ``add_rms_norm``: h (at ``h_row``) += r in h's dtype (stored in place), then RMSNorm(h) * w
    into ``out_row``, each rounded as HF's modules round them (``add_rms_norm_ref``)."""
    h = tl.load(h_row + i, mask=m, other=0.0)
    s = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)  # the residual add, rounded as the module's
    tl.store(h_row + i, s, mask=m)
    x = s.to(tl.float32)
    var = tl.sum(x * x, 0) / N
    y = (x * (1.0 / tl.sqrt_rn(var + eps))).to(out_row.dtype.element_ty)
    w = tl.load(w_ptr + i, mask=m, other=0.0)
    tl.store(out_row + i, (y.to(tl.float32) * w.to(tl.float32)).to(out_row.dtype.element_ty), mask=m)


@triton.jit
def _gemv_out(acc, acc_u, b_ptr, out_ptr, r, n, B, N, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """The GEMV's epilogue: + bias (float32), rounded to the output dtype; under SILU the gate (``acc``) and up
    (``acc_u``) halves each rounded, then ``silu(gate) * up`` rounded as ``silu_mul_kernel`` rounds it."""
    nmask = n < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    if SILU:
        if HAS_BIAS:
            acc_u += tl.load(b_ptr + N + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        up = acc_u.to(out_ptr.dtype.element_ty)
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
        y = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r[:, None] * N + n[None, :], y, mask=(r < B)[:, None] & nmask[None, :])


@triton.jit
def _gemv_weights(w_ptr, n, k, N, nmask, kmask, stride_w, SILU: tl.constexpr):
    """One block of the GEMV's weights: rows ``n`` at inputs ``k`` (BLOCK_N, BLOCK_K), and under SILU the up rows
    n + N (else the same block again, unused)."""
    wmask = nmask[:, None] & kmask[None, :]
    w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=wmask, other=0.0)
    wu = w
    if SILU:
        wu = tl.load(w_ptr + (n[:, None] + N) * stride_w + k[None, :], mask=wmask, other=0.0)
    return w, wu


@triton.jit
def _gemv_block(acc, acc_u, x, w, wu, SILU: tl.constexpr, IEEE: tl.constexpr):
    """acc (BP, BLOCK_N) += x (BP, BLOCK_K) @ w^T, and acc_u += x @ wu^T under SILU."""
    acc += _dot(x, tl.trans(w), IEEE)
    if SILU:
        acc_u += _dot(x, tl.trans(wu), IEEE)
    return acc, acc_u


@triton.jit
def _gemv_weights_at(w_ptr, n, k_lo, j: tl.constexpr, N, KD, nmask, stride_w, BLOCK_K: tl.constexpr,
                     SILU: tl.constexpr):
    """``_gemv_weights`` of the split's block ``j``: inputs k_lo + j BLOCK_K ..."""
    k = k_lo + j * BLOCK_K + tl.arange(0, BLOCK_K)
    return _gemv_weights(w_ptr, n, k, N, nmask, k < KD, stride_w, SILU)


@triton.jit
def _gemv_x_at(acc, acc_u, x_ptr, r, rmask, stride_x, k_lo, j: tl.constexpr, KD, w, wu, BLOCK_K: tl.constexpr,
               SILU: tl.constexpr, IEEE: tl.constexpr):
    """``_gemv_block`` of the split's block ``j`` with its weights already loaded (w, wu): loads its inputs x."""
    k = k_lo + j * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + r[:, None] * stride_x + k[None, :], mask=rmask[:, None] & (k < KD)[None, :], other=0.0)
    return _gemv_block(acc, acc_u, x, w, wu, SILU, IEEE)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, B, N, KD, stride_x, stride_w,
                K_PER: tl.constexpr, BP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, IEEE: tl.constexpr,
                PRE: tl.constexpr, PDL: tl.constexpr):
    """out (B, N) = x (B, KD) @ w[:N]^T (+ bias) for B <= BP rows, each program BLOCK_N outputs over one of SPLIT
    slices of KD (SPLIT > 1: float32 partials (SPLIT, BP, NW) to ``part_ptr``, summed in order by
    ``gemv_reduce_kernel``). SILU: w holds 2N rows (gate, then up); out = silu(gate) * up. The first PRE (0-8)
    blocks of the slice's weights are loaded before anything else, under PDL before ``_pdl_enter`` (no kernel of
    the decode step writes a weight), so they stream while the kernel before finishes; then the inputs x (the
    kernel before's output) and the loop over the other blocks. The blocks are summed in the same order whatever
    PRE is, so PRE changes no bit. Without PDL one loop takes every block (PRE 0): with the first apart, a decode
    step of the 1.5B shape took ~4% longer there (H200, 2026-12-03, BENCHMARKS.md)."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.arange(0, BP)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = r < B
    nmask = n < N
    k_lo = s * K_PER  # K_PER: the inputs of one split, whole blocks
    acc = tl.zeros([BP, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BP, BLOCK_N], tl.float32)
    # the first PRE blocks of weights, each in registers of its own (Triton has no indexable list of blocks)
    if PRE > 0:
        w0, u0 = _gemv_weights_at(w_ptr, n, k_lo, 0, N, KD, nmask, stride_w, BLOCK_K, SILU)
    if PRE > 1:
        w1, u1 = _gemv_weights_at(w_ptr, n, k_lo, 1, N, KD, nmask, stride_w, BLOCK_K, SILU)
    if PRE > 2:
        w2, u2 = _gemv_weights_at(w_ptr, n, k_lo, 2, N, KD, nmask, stride_w, BLOCK_K, SILU)
    if PRE > 3:
        w3, u3 = _gemv_weights_at(w_ptr, n, k_lo, 3, N, KD, nmask, stride_w, BLOCK_K, SILU)
    if PRE > 4:
        w4, u4 = _gemv_weights_at(w_ptr, n, k_lo, 4, N, KD, nmask, stride_w, BLOCK_K, SILU)
    if PRE > 5:
        w5, u5 = _gemv_weights_at(w_ptr, n, k_lo, 5, N, KD, nmask, stride_w, BLOCK_K, SILU)
    if PRE > 6:
        w6, u6 = _gemv_weights_at(w_ptr, n, k_lo, 6, N, KD, nmask, stride_w, BLOCK_K, SILU)
    if PRE > 7:
        w7, u7 = _gemv_weights_at(w_ptr, n, k_lo, 7, N, KD, nmask, stride_w, BLOCK_K, SILU)
    _pdl_enter(PDL)  # x: the kernel before's output
    if PRE > 0:
        acc, acc_u = _gemv_x_at(acc, acc_u, x_ptr, r, rmask, stride_x, k_lo, 0, KD, w0, u0, BLOCK_K, SILU, IEEE)
    if PRE > 1:
        acc, acc_u = _gemv_x_at(acc, acc_u, x_ptr, r, rmask, stride_x, k_lo, 1, KD, w1, u1, BLOCK_K, SILU, IEEE)
    if PRE > 2:
        acc, acc_u = _gemv_x_at(acc, acc_u, x_ptr, r, rmask, stride_x, k_lo, 2, KD, w2, u2, BLOCK_K, SILU, IEEE)
    if PRE > 3:
        acc, acc_u = _gemv_x_at(acc, acc_u, x_ptr, r, rmask, stride_x, k_lo, 3, KD, w3, u3, BLOCK_K, SILU, IEEE)
    if PRE > 4:
        acc, acc_u = _gemv_x_at(acc, acc_u, x_ptr, r, rmask, stride_x, k_lo, 4, KD, w4, u4, BLOCK_K, SILU, IEEE)
    if PRE > 5:
        acc, acc_u = _gemv_x_at(acc, acc_u, x_ptr, r, rmask, stride_x, k_lo, 5, KD, w5, u5, BLOCK_K, SILU, IEEE)
    if PRE > 6:
        acc, acc_u = _gemv_x_at(acc, acc_u, x_ptr, r, rmask, stride_x, k_lo, 6, KD, w6, u6, BLOCK_K, SILU, IEEE)
    if PRE > 7:
        acc, acc_u = _gemv_x_at(acc, acc_u, x_ptr, r, rmask, stride_x, k_lo, 7, KD, w7, u7, BLOCK_K, SILU, IEEE)
    for i in range(PRE, K_PER // BLOCK_K):
        k = k_lo + i * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = k < KD
        x = tl.load(x_ptr + r[:, None] * stride_x + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w, wu = _gemv_weights(w_ptr, n, k, N, nmask, kmask, stride_w, SILU)
        acc, acc_u = _gemv_block(acc, acc_u, x, w, wu, SILU, IEEE)
    if SPLIT == 1:
        _gemv_out(acc, acc_u, b_ptr, out_ptr, r, n, B, N, HAS_BIAS, SILU)
    else:
        NW = 2 * N if SILU else N
        at = part_ptr + (s * BP + r[:, None]) * NW + n[None, :]
        tl.store(at, acc, mask=nmask[None, :])
        if SILU:
            tl.store(at + N, acc_u, mask=nmask[None, :])


@triton.jit
def gemv_reduce_kernel(part_ptr, b_ptr, out_ptr, B, N, BP: tl.constexpr, BLOCK_N: tl.constexpr,
                       SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr):
    """The sum of ``gemv_kernel``'s SPLIT partials, in split order (deterministic), and its epilogue."""
    _pdl_enter(PDL)
    pid = tl.program_id(0)
    r = tl.arange(0, BP)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    NW = 2 * N if SILU else N
    acc = tl.zeros([BP, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BP, BLOCK_N], tl.float32)
    for s in tl.static_range(SPLIT):
        at = part_ptr + (s * BP + r[:, None]) * NW + n[None, :]
        acc += tl.load(at, mask=nmask[None, :], other=0.0)
        if SILU:
            acc_u += tl.load(at + N, mask=nmask[None, :], other=0.0)
    _gemv_out(acc, acc_u, b_ptr, out_ptr, r, n, B, N, HAS_BIAS, SILU)


@triton.jit
def gemv_reduce_add_norm_kernel(part_ptr, b_ptr, h_ptr, w_ptr, out_ptr, N, eps, stride_h, BP: tl.constexpr,
                                BLOCK: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """Row r: ``gemv_reduce_kernel``'s sum of the SPLIT partials (split order) + bias, rounded (the projection's
    output), then ``add_rms_norm_kernel``: h += it (in place), out = RMSNorm(h) * w, each rounded as there."""
    _pdl_enter(PDL)
    r = tl.program_id(0)
    n = tl.arange(0, BLOCK)
    m = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + (s * BP + r) * N + n, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=m, other=0.0).to(tl.float32)
    y = acc.to(h_ptr.dtype.element_ty)  # the projection's output, rounded
    _add_rms_norm_row(h_ptr + r * stride_h, y, w_ptr, out_ptr + r * N, n, m, N, eps)

"""The decode step's fused operations, each as a plain torch reference and a Triton kernel.

The static decoder (``engines.static``) runs one token per row through the layers; on CUDA each of
these operations is one kernel instead of several, and every kernel reads its varying values (the
token index, the attention span) from device tensors, so one CUDA graph serves every position:

- ``rope_attention``: from the raw q/k/v projection, the rotary embedding of q and k at each row's
  position (cos/sin looked up in a table), the write of k and v into the KV cache at the new token's
  slot (``end - 1``), and one query token per row against cache slots ``start_b <= s < end``
  (grouped-query: each K/V head serves its G query heads), split over the cache length and merged
  (flash decoding: 2 kernels, reading only the visible slots; the split holding the new slot writes it
  before reading it), instead of rotary / cache-write ops and a matmul / mask / softmax / cast / matmul
  over a bucket of slots;
- ``rms_norm`` / ``add_rms_norm``: HF's RMSNorm of one row per token, after the residual add (one
  kernel; the projections before it are plain matmuls, with no copy of the residual into their output);
  ``linear_add_rms_norm``: a projection split over its inputs, its partials summed in the same kernel as
  the residual add and the norm that follow it (the output and down projections);
- ``silu_mul``: ``silu(gate) * up`` (2 kernels -> 1);
- ``gumbel_argmax``: the sampled id of ``engines.sampling.policy_scores`` at top-p 1: the argmax over
  the tokenizer's ids of ``z / τ + Gumbel(seed, t, id)`` in float64, the noise hashed in-kernel
  (``engines.sampling.uniform_noise``'s splitmix64), ~40 elementwise kernels over (B, V) -> 1 + a
  small argmax; ``sample_token``: that id, its float32 log π (the log-softmax's parts computed in the
  same pass over the logits, merged by a second kernel) and the step's writes, in 2 kernels; at top-p < 1
  after a search of the nucleus (``nucleus_*_kernel``: the 16-bit logits' sort keys counted into a histogram,
  each key's float64 mass is its count times one id's, so the nucleus's last key and how many of its ids it
  holds follow from the histogram; those ids taken in id order as ``engines.sampling.top_p_filter``'s stable
  sort takes them).

Shapes: B rows, H query heads, K = Hkv key/value heads, G = H / K, D head dim, L cache slots, V
vocabulary, X = (H + 2K) D the fused q/k/v width, I the MLP width. The references define the
semantics; ``tests/test_decode_kernels.py`` runs the kernels (Triton's interpreter on a CPU) against
them. Triton is optional: ``available()`` says whether the kernels can run on a device.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from opdkit.engines.sampling import _GOLDEN, _MIX1, _MIX2, UNIFORM_BITS

# --- references (any device) ------------------------------------------------------------------


def rotate(x_B_N_D: torch.Tensor, cos_B_D: torch.Tensor, sin_B_D: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding ``x * cos + rotate_half(x) * sin`` for one position per row, computed in
    float32 and rounded once to x's dtype (as a matmul by the rotation matrix rounds it)."""
    half = x_B_N_D.shape[-1] // 2
    x = x_B_N_D.float()
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos_B_D.float()[:, None] + rot * sin_B_D.float()[:, None]).to(x_B_N_D.dtype)


def rope_cache_ref(qkv_B_X, cos_P_D, sin_P_D, pos_B, slot, k_cache_B_K_L_D, v_cache_B_K_L_D, H: int, K: int):
    """Rotated queries (B, H, D); k rotated and v written into the caches at slot ``slot`` (an int or
    a 1-element tensor), in place."""
    B, D = qkv_B_X.shape[0], cos_P_D.shape[1]
    q_B_H_D = qkv_B_X[:, :H * D].view(B, H, D)
    k_B_K_D = qkv_B_X[:, H * D:(H + K) * D].view(B, K, D)
    v_B_K_D = qkv_B_X[:, (H + K) * D:].view(B, K, D)
    cos_B_D, sin_B_D = cos_P_D[pos_B], sin_P_D[pos_B]
    s = int(slot)
    k_cache_B_K_L_D[:, :, s] = rotate(k_B_K_D, cos_B_D, sin_B_D)
    v_cache_B_K_L_D[:, :, s] = v_B_K_D
    return rotate(q_B_H_D, cos_B_D, sin_B_D)


def rope_attention_ref(qkv_B_X, cos_P_D, sin_P_D, pos_B, k_cache_B_K_L_D, v_cache_B_K_L_D, start_B, end: int,
                       scale: float, H: int, K: int) -> torch.Tensor:
    """``rope_cache_ref`` at slot ``end - 1`` (the new token's k and v into the caches, in place), then
    ``attention_ref`` of its rotated queries over slots ``start_b <= s < end``: (B, H, D)."""
    q_B_H_D = rope_cache_ref(qkv_B_X, cos_P_D, sin_P_D, pos_B, int(end) - 1, k_cache_B_K_L_D, v_cache_B_K_L_D, H, K)
    return attention_ref(q_B_H_D, k_cache_B_K_L_D, v_cache_B_K_L_D, start_B, end, scale)


def attention_ref(q_B_H_D, k_cache_B_K_L_D, v_cache_B_K_L_D, start_B, end: int, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over cache slots ``start_b <= s < end`` of each row, in float32;
    (B, H, D) in q's dtype. Query head h reads K/V head h // G."""
    B, H, D = q_B_H_D.shape
    K, L = k_cache_B_K_L_D.shape[1], k_cache_B_K_L_D.shape[2]
    G = H // K
    q_B_K_G_D = q_B_H_D.float().view(B, K, G, D)
    scores_B_K_G_L = torch.matmul(q_B_K_G_D, k_cache_B_K_L_D.float().transpose(-1, -2)) * scale
    s_L = torch.arange(L, device=q_B_H_D.device)
    visible_B_L = (s_L[None, :] >= start_B[:, None]) & (s_L[None, :] < int(end))
    scores_B_K_G_L = scores_B_K_G_L.masked_fill(~visible_B_L[:, None, None, :], float("-inf"))
    out_B_K_G_D = torch.matmul(scores_B_K_G_L.softmax(-1), v_cache_B_K_L_D.float())
    return out_B_K_G_D.reshape(B, H, D).to(q_B_H_D.dtype)


def rms_norm_ref(x_B_H: torch.Tensor, weight_H: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen RMSNorm: float32 statistics, the normalised row rounded to x's dtype, then times the
    weight in that dtype."""
    x32_B_H = x_B_H.float()
    y_B_H = x32_B_H * torch.rsqrt(x32_B_H.pow(2).mean(-1, keepdim=True) + eps)
    return weight_H * y_B_H.to(x_B_H.dtype)


def add_rms_norm_ref(h_B_H: torch.Tensor, r_B_H: torch.Tensor, weight_H: torch.Tensor, eps: float):
    """The residual add ``h += r`` in h's dtype (in place), then ``rms_norm_ref`` of the sum: (h, normed)."""
    h_B_H.add_(r_B_H)
    return h_B_H, rms_norm_ref(h_B_H, weight_H, eps)


def silu_mul_ref(gu_B_X: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate/up projection (B, 2I) -> (B, I), each op rounded to the
    input dtype as the module's ``act_fn(gate) * up`` rounds it."""
    gate_B_I, up_B_I = gu_B_X.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate_B_I) * up_B_I


def linear_ref(x_B_K: torch.Tensor, w_N_K: torch.Tensor, b_N: torch.Tensor | None) -> torch.Tensor:
    """``x @ w^T + b`` (B, N): float32 accumulation, the bias added before one rounding to x's dtype (as
    cuBLAS's bias epilogue rounds it)."""
    out_B_N = x_B_K.float() @ w_N_K.float().T
    return (out_B_N if b_N is None else out_B_N + b_N.float()).to(x_B_K.dtype)


def linear_silu_ref(x_B_K: torch.Tensor, w_2I_K: torch.Tensor, b_2I: torch.Tensor | None) -> torch.Tensor:
    """``silu_mul_ref`` of ``linear_ref``: the MLP's gate/up projection and activation (B, I)."""
    return silu_mul_ref(linear_ref(x_B_K, w_2I_K, b_2I))


def gumbel_argmax_ref(raw_B_V: torch.Tensor, seeds_B: torch.Tensor, t, temperature: float,
                      n_vocab: int) -> torch.Tensor:
    """The id ``policy_scores`` samples at top-p 1 and temperature > 0 (B,): argmax over ids < n_vocab
    of float64 ``raw / τ`` + the Gumbel noise of ``(seed_b, t, id)``."""
    from opdkit.engines.sampling import policy_scores

    scores_B_V, _ = policy_scores(raw_B_V, seeds_B, t, temperature, 1.0, n_vocab)
    return scores_B_V.argmax(-1)


# --- Triton kernels ---------------------------------------------------------------------------


def available() -> bool:
    """Triton is importable (the kernels then run on CUDA, or anywhere under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


_K = None


def _kernels() -> dict:
    """The Triton kernels (``engines.decode_triton``), imported at first use: importing this module
    never imports Triton."""
    global _K
    if _K is None:
        from opdkit.engines import decode_triton as t

        assert UNIFORM_BITS == 52 and _GOLDEN + (1 << 64) == 0x9E3779B97F4A7C15  # the constants written there
        assert (_MIX1 + (1 << 64), _MIX2 + (1 << 64)) == (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
        _K = dict(rope_attn_partial=t.rope_attn_partial_kernel, attn_reduce=t.attn_reduce_kernel,
                  silu_mul=t.silu_mul_kernel, gumbel=t.gumbel_kernel, nucleus_hist=t.nucleus_hist_kernel,
                  nucleus_mass=t.nucleus_mass_kernel, nucleus_pick=t.nucleus_pick_kernel,
                  nucleus_ties=t.nucleus_ties_kernel,
                  sample_finish=t.sample_finish_kernel,
                  rms_norm=t.rms_norm_kernel, add_rms_norm=t.add_rms_norm_kernel, gemv=t.gemv_kernel,
                  gemv_reduce=t.gemv_reduce_kernel, gemv_reduce_add_norm=t.gemv_reduce_add_norm_kernel)
    return _K


def pdl_available(device) -> bool:
    """Programmatic dependent launch can be used on ``device``: a CUDA device of compute capability 9 or later
    (Hopper), a Triton that launches with ``launch_pdl`` and has ``gdc_wait``, not Triton's interpreter. With it
    each kernel's launch overlaps the kernel before it (``decode_triton._pdl_enter``); no result changes."""
    device = torch.device(device)
    if device.type != "cuda" or not available() or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(cuda, "gdc_wait")


def _launch(pdl: bool) -> dict:
    """The launch arguments of every kernel here, with (``pdl``) or without programmatic dependent launch. FP
    fusion (a multiply and an add contracted into one FMA where the code does not round between them) is asked
    for, not left to Triton's default: it was on in every Triton these kernels were checked and measured with,
    and Triton 3.9 warns that its default turns it off in 3.10, which would change the decoder's float32 sums
    (rotary, the GEMV epilogue, the softmax) in their last bits."""
    return dict(PDL=pdl, enable_fp_fusion=True, **({"launch_pdl": True} if pdl else {}))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class AttentionPlan:
    """The split of a cache of ``L`` slots over (B, K) heads for ``attention`` (flash decoding), with
    its preallocated float32 partials, so a CUDA graph can replay it: NSPLIT splits (about ``programs`` programs in
    all) sharing the visible slots of each step in whole blocks of ``block_n`` slots (at most CHUNK = ``chunk``
    slots a split, at the capacity), each program reading only the visible slots of its split; ``num_warps`` /
    ``num_stages``: the partials kernel's launch (on an H200 the stages changed no bit, 8 warps did at 7,408 slots).
    The defaults are the fastest of ``bench/attn_bench.py``'s grid on an H200 at 1,264 / 3,312 / 7,408 slots
    (2026-12-03, BENCHMARKS.md: 22.3 us a layer at 7,168 visible slots, was 25.1); ``pdl``: launched with
    programmatic dependent launch (``pdl_available``). The split and ``block_n`` decide the order in which the
    online softmax sums a row's slots: another split or block gives other float32 roundings of the same sums."""

    def __init__(self, B: int, H: int, K: int, D: int, L: int, device, programs: int = 256, num_warps: int = 4,
                 num_stages: int = 3, pdl: bool = False, block_n: int = 32):
        self.B, self.H, self.K, self.D, self.L = B, H, K, D, L
        self.num_warps, self.num_stages, self.pdl, self.BLOCK_N = num_warps, num_stages, pdl, block_n
        # programs / (B K) splits, at most 64, and at least two blocks a split at the capacity (a smaller cache is
        # not worth more programs and merge inputs: the 1.5B shape's 1,264 slots still split 16 ways, 96 slots each)
        splits = max(1, min(64, _next_pow2(-(-programs // (B * K))), L // (2 * block_n)))
        per_split = -(-L // splits)
        self.chunk = -(-per_split // self.BLOCK_N) * self.BLOCK_N  # slots per split at the capacity, whole blocks
        self.nsplit = -(-L // self.chunk)
        self.acc = torch.empty((B, H, self.nsplit, D), dtype=torch.float32, device=device)
        self.m = torch.empty((B, H, self.nsplit), dtype=torch.float32, device=device)
        self.l = torch.empty((B, H, self.nsplit), dtype=torch.float32, device=device)


def rope_attention(qkv_B_X, cos_P_D, sin_P_D, pos_B, k_cache_B_K_L_D, v_cache_B_K_L_D, start_B, end_1, scale: float,
                   plan: AttentionPlan, H: int, K: int, end_offset: int = 0) -> torch.Tensor:
    """``rope_attention_ref`` with ``end = end_1 + end_offset`` read on the device (``end_1``: a 1-element int64
    tensor): two kernels, the partials (``plan``) and their merge."""
    k = _kernels()
    B, D = qkv_B_X.shape[0], cos_P_D.shape[1]
    G = H // K
    sb, sk, sl, _ = k_cache_B_K_L_D.stride()
    k["rope_attn_partial"][(B, K, plan.nsplit)](
        qkv_B_X, cos_P_D, sin_P_D, pos_B, k_cache_B_K_L_D, v_cache_B_K_L_D, start_B, end_1, end_offset, plan.acc,
        plan.m, plan.l, scale, qkv_B_X.stride(0), sb, sk, sl, H=H, K=K, G=G, GP=max(16, _next_pow2(G)), D=D,
        CHUNK=plan.chunk, BLOCK_N=plan.BLOCK_N, NSPLIT=plan.nsplit, IEEE=qkv_B_X.dtype == torch.float32,
        STATIC_LOOP=os.environ.get("TRITON_INTERPRET") == "1", num_warps=plan.num_warps, num_stages=plan.num_stages,
        **_launch(plan.pdl))
    out_B_H_D = torch.empty((B, H, D), dtype=qkv_B_X.dtype, device=qkv_B_X.device)
    k["attn_reduce"][(B * H,)](plan.acc, plan.m, plan.l, out_B_H_D, NSPLIT=plan.nsplit, NSP=_next_pow2(plan.nsplit),
                               D=D, **_launch(plan.pdl))
    return out_B_H_D


def rms_norm(x_B_H: torch.Tensor, weight_H: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    k = _kernels()
    B, N = x_B_H.shape
    out_B_H = torch.empty((B, N), dtype=x_B_H.dtype, device=x_B_H.device)
    k["rms_norm"][(B,)](x_B_H, weight_H, out_B_H, N, eps, x_B_H.stride(0), BLOCK=_next_pow2(N), **_launch(pdl))
    return out_B_H


def add_rms_norm(h_B_H: torch.Tensor, r_B_H: torch.Tensor, weight_H: torch.Tensor, eps: float, pdl: bool = False):
    """``add_rms_norm_ref`` as one kernel (``h_B_H`` updated in place)."""
    k = _kernels()
    B, N = h_B_H.shape
    out_B_H = torch.empty((B, N), dtype=h_B_H.dtype, device=h_B_H.device)
    k["add_rms_norm"][(B,)](h_B_H, r_B_H, weight_H, out_B_H, N, eps, h_B_H.stride(0), r_B_H.stride(0),
                            BLOCK=_next_pow2(N), **_launch(pdl))
    return h_B_H, out_B_H


def silu_mul(gu_B_X: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    k = _kernels()
    B, inter = gu_B_X.shape[0], gu_B_X.shape[1] // 2
    out_B_I = torch.empty((B, inter), dtype=gu_B_X.dtype, device=gu_B_X.device)
    BLOCK = 1024
    k["silu_mul"][(B, -(-inter // BLOCK))](gu_B_X, out_B_I, inter, gu_B_X.stride(0), BLOCK=BLOCK, **_launch(pdl))
    return out_B_I


class GumbelPlan:
    """Preallocated per-block maxima and log-softmax parts for ``gumbel_argmax`` / ``sample_token`` over V ids in
    blocks of BLOCK; ``pdl`` as in ``AttentionPlan``. BLOCK 1,024 ids with 4 warps: ``sample_token`` took 17.9 us per
    step at batch 8 over 151,665 ids on an H200 (2026-12-03, ``bench/s1_speed.py sample``), against 33.7 at 4,096
    (the float64 Gumbel noise of 38 programs per row hid too little latency), 20.8 at 2,048 and 17.3 at 512.
    ``top_p`` < 1 (``sample_token`` only, 16-bit float logits): also the buffers of the nucleus search."""

    BLOCK = 1024
    WARPS = 4
    CH = 256  # the sort keys of one program of nucleus_mass_kernel

    def __init__(self, B: int, n_vocab: int, temperature: float, device, pdl: bool = False, block: int | None = None,
                 warps: int | None = None, top_p: float = 1.0, chunk: int | None = None):
        self.n_vocab, self.temperature, self.top_p, self.pdl = n_vocab, float(temperature), float(top_p), pdl
        self.block, self.warps = block or self.BLOCK, warps or self.WARPS  # ids per program, warps (the same samples)
        self.CH = chunk or self.CH  # sort keys per program of the chunk masses, a power of 2 (the same samples)
        self.nblk = -(-n_vocab // self.block)
        self.val = torch.empty((B, self.nblk), dtype=torch.float64, device=device)
        self.idx = torch.empty((B, self.nblk), dtype=torch.int64, device=device)
        self.m = torch.empty((B, self.nblk), dtype=torch.float32, device=device)
        self.s = torch.empty((B, self.nblk), dtype=torch.float32, device=device)
        self.tau_1 = torch.full((1,), self.temperature, dtype=torch.float64, device=device)
        # torch divides a CUDA float32 tensor by a Python float as a product with its float32 reciprocal
        self.inv_tau = float(torch.tensor(1.0) / torch.tensor(self.temperature, dtype=torch.float32))
        self.nucleus = self.top_p < 1.0
        n = B if self.nucleus else 1  # the search's buffers (unread at top-p 1)
        self.p_1 = torch.full((1,), self.top_p, dtype=torch.float64, device=device)
        self.hist = torch.zeros((n, 65536), dtype=torch.int32, device=device)  # each sort key's ids
        self.bmax = torch.empty((n, self.nblk), dtype=torch.float64, device=device)  # each block's largest z
        self.cmass = torch.empty((n, 65536 // self.CH), dtype=torch.float64, device=device)  # each chunk's mass
        self.ccnt = torch.empty((n, 65536 // self.CH), dtype=torch.int32, device=device)  # ... and its ids
        self.skey = torch.empty((n, 2), dtype=torch.int64, device=device)  # the nucleus's last key k, n of its ids
        self.ties = torch.empty((n, self.nblk), dtype=torch.int32, device=device)  # each block's ids of key k


def _gumbel_blocks(raw_B_V, seeds_B, t_1, plan: GumbelPlan, nucleus: bool = False) -> None:
    """``gumbel_kernel`` over the blocks; where ``nucleus``, after the nucleus search: the histogram of the logits'
    sort keys (zeroed, then counted), each chunk's mass, the nucleus's last key and its ids per block."""
    k = _kernels()
    B = raw_B_V.shape[0]
    tempered = plan.temperature != 1.0
    nbp = _next_pow2(plan.nblk)
    if nucleus:
        if raw_B_V.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"sample_token at top-p < 1: bfloat16 or float16 logits expected, not {raw_B_V.dtype}")
        grid, stride = (B, plan.nblk), raw_B_V.stride(0)
        plan.hist.zero_()
        k["nucleus_hist"][grid](raw_B_V, plan.tau_1, plan.hist, plan.bmax, plan.n_vocab, stride, NBLK=plan.nblk,
                                BLOCK=plan.block, TEMPERED=tempered, num_warps=plan.warps, **_launch(plan.pdl))
        k["nucleus_mass"][(B, 65536 // plan.CH)](
            raw_B_V, plan.tau_1, plan.hist, plan.bmax, plan.cmass, plan.ccnt, NBLK=plan.nblk, NBP=nbp, CH=plan.CH,
            TEMPERED=tempered, num_warps=4, **_launch(plan.pdl))
        k["nucleus_pick"][(B,)](raw_B_V, plan.tau_1, plan.p_1, plan.hist, plan.bmax, plan.cmass, plan.ccnt, plan.skey,
                                NBLK=plan.nblk, NBP=nbp, CH=plan.CH, TEMPERED=tempered, num_warps=8,
                                **_launch(plan.pdl))
        k["nucleus_ties"][grid](raw_B_V, plan.skey, plan.ties, plan.n_vocab, stride, NBLK=plan.nblk,
                                BLOCK=plan.block, num_warps=plan.warps, **_launch(plan.pdl))
    k["gumbel"][(B, plan.nblk)](
        raw_B_V, seeds_B, t_1, plan.tau_1, plan.val, plan.idx, plan.m, plan.s, plan.n_vocab, raw_B_V.stride(0),
        plan.inv_tau, plan.skey, plan.ties, NBLK=plan.nblk, BLOCK=plan.block, TEMPERED=tempered, NUCLEUS=nucleus,
        NBP=nbp, num_warps=plan.warps, **_launch(plan.pdl))


def gumbel_argmax(raw_B_V, seeds_B, t_1, plan: GumbelPlan) -> torch.Tensor:
    """``gumbel_argmax_ref`` at ``plan.temperature`` (float32 or bfloat16 ``raw_B_V``; ``t_1`` a 1-element int64
    device tensor). Top-p 1 only (the plan's top-p is not read)."""
    _gumbel_blocks(raw_B_V, seeds_B, t_1, plan)
    best_B = plan.val.argmax(-1, keepdim=True)
    return plan.idx.gather(1, best_B)[:, 0]


def sample_token_ref(raw_B_V, seeds_B, t, temperature: float, n_vocab: int,
                     top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The id ``policy_scores`` samples (B,) and its recorded log π (B,) float32."""
    from opdkit.engines.sampling import policy_scores

    scores_B_V, logp_B_V = policy_scores(raw_B_V.float(), seeds_B, t, temperature, top_p, n_vocab)
    new_B = scores_B_V.argmax(-1)
    return new_B, logp_B_V.gather(1, new_B[:, None])[:, 0]


def sample_token(raw_B_V, seeds_B, t_1, plan: GumbelPlan, ids_B_T, logp_B_T, tok_B, pos_B, done_B, eos_E) -> None:
    """One sampling step of the static decoder at ``plan.temperature`` and ``plan.top_p``: ``sample_token_ref``'s id
    (the same) and log π (its float32 log-softmax summed in another order: within a few float32 ulps) written into
    column ``t`` (``t_1``'s value) of ``ids_B_T`` / ``logp_B_T``, the id into ``tok_B``, ``pos_B`` advanced by one,
    ``done_B`` (bool) set where the id is in ``eos_E``. 2 kernels at top-p 1, replacing ~15: the logits' float32
    copy, the log-softmax, the argmax over blocks, the gathers, the writes and the end test. At top-p < 1 (bfloat16
    or float16 logits) first the nucleus search (a histogram of the logits' 65,536 sort keys, each key's float64
    mass from its count, the nucleus's last key and its ties: 5 kernels), replacing the torch sampler's float64
    stable sort, softmax, cumulative sum and scatter over every row: the same nucleus except where the mass before
    an id is within float64 rounding of p (the sums run in another order)."""
    B = raw_B_V.shape[0]
    _gumbel_blocks(raw_B_V, seeds_B, t_1, plan, nucleus=plan.nucleus)
    _kernels()["sample_finish"][(B,)](
        raw_B_V, plan.val, plan.idx, plan.m, plan.s, t_1, eos_E, eos_E.numel(), ids_B_T, logp_B_T, tok_B, pos_B,
        done_B.view(torch.uint8), raw_B_V.stride(0), ids_B_T.stride(0), plan.inv_tau, NBLK=plan.nblk,
        NBP=_next_pow2(plan.nblk), NEP=_next_pow2(max(1, eos_E.numel())), TEMPERED=plan.temperature != 1.0,
        **_launch(plan.pdl))


# --- the projections at a small batch (GEMV) ------------------------------------------------------

GEMV_MAX_ROWS = 16  # the GEMV kernel pads the rows to 16 (tl.dot's smallest M); more rows: cuBLAS


def gemv_config(N: int, K: int, sms: int = 132) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages, PRE) for ``gemv_launch`` of N outputs over K inputs. The
    rule picks the fastest configuration of ``bench/gemv_bench.py``'s grid on an H200 (2026-12-02, batch 8, 28
    weights per graph) at each projection of the 1.5B shape: up to 2,048 inputs one pass (BLOCK_N 16 x BLOCK_K
    256 up to 4,096 outputs: q/k/v 5.53 us vs cuBLAS 5.86, o 4.97 vs 5.24; else 32 x 64: gate/up + silu 16.37
    vs 19.09 with its separate kernel); longer inputs split in powers of 2 until the programs fill ~70% of
    the ``sms`` multiprocessors (down 64 x 256 x 4: 11.49 vs 11.74). PRE: the blocks of weights each program
    loads before the kernel before has finished (under programmatic dependent launch; ``gemv_kernel``): 2 for
    the output projection (1,536 x 1,536: the decoder +0.5 to +1.2% in three measurements), 1 elsewhere (more
    was slower at every projection, by up to 22%: the registers the blocks hold; ``bench/gemv_pre_bench.py`` in
    the decoder at 1,024 new tokens, H200, 2026-12-04, BENCHMARKS.md); never more than a split's blocks."""
    if K <= 2048:
        return (16, 256, 1, 4, 4, 2 if N <= 1536 and K > 256 else 1) if N <= 4096 else (32, 64, 1, 4, 4, 1)
    block_n, block_k, split = 64, 256, 1
    while -(-N // block_n) * split < 0.7 * sms and K // (2 * split) >= block_k:
        split *= 2
    return block_n, block_k, split, 4, 4, 1


def gemv_launch(x_B_K, w_X_K, b_X, N: int, silu: bool, config=None, add_norm=None, pdl: bool = False):
    """``linear_ref`` (silu False: w (N, K)) or ``linear_silu_ref`` (silu True: w (2N, K), gate rows then up
    rows) for B <= GEMV_MAX_ROWS rows as one kernel (SPLIT 1) or two (the float32 partials summed in a
    fixed order); ``config`` as ``gemv_config`` returns it (the default: ``gemv_config(N, K)``, whose PRE
    applies under ``pdl``; without it one loop, PRE 0); an explicit ``config``'s PRE applies as given, five
    values mean PRE 1 under ``pdl``, else 0. ``add_norm`` = (h (B, N), norm weight (N,), eps): ``add_rms_norm``
    of h and the projection follows (h updated in place; returns (h, normed)), its sum of the partials in the
    same kernel when the projection is split; ``pdl``: launched with programmatic dependent launch
    (``pdl_available``)."""
    k = _kernels()
    B, KD = x_B_K.shape
    if B > GEMV_MAX_ROWS or x_B_K.stride(1) != 1 or w_X_K.stride(1) != 1:
        raise ValueError(f"gemv: {B} rows (at most {GEMV_MAX_ROWS}) with unit-stride rows expected")
    block_n, block_k, split, warps, stages, *pre = config or gemv_config(N, KD)
    pre = pre[0] if pre and (pdl or config is not None) else int(pdl)  # without PDL by default: one loop
    per_split = -(-KD // split)
    per_split = -(-per_split // block_k) * block_k  # inputs per split, whole blocks
    if not 0 <= pre <= min(8, per_split // block_k):
        raise ValueError(f"gemv: PRE {pre}: expected 0 to 8 and at most the {per_split // block_k} blocks of a split")
    out_B_N = torch.empty((B, N), dtype=x_B_K.dtype, device=x_B_K.device)
    BP = GEMV_MAX_ROWS
    part = (torch.empty((split, BP, 2 * N if silu else N), dtype=torch.float32, device=x_B_K.device) if split > 1
            else out_B_N)
    bias = b_X if b_X is not None else out_B_N  # unread without HAS_BIAS
    grid = (-(-N // block_n), split)
    ieee = x_B_K.dtype == torch.float32
    k["gemv"][grid](x_B_K, w_X_K, bias, out_B_N, part, B, N, KD, x_B_K.stride(0), w_X_K.stride(0),
                    K_PER=per_split, BP=BP, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, HAS_BIAS=b_X is not None,
                    SILU=silu, IEEE=ieee, PRE=pre, num_warps=warps, num_stages=stages, **_launch(pdl))
    if add_norm is not None and split > 1:  # the partials' sum, the residual add and the norm: one kernel
        h_B_N, weight_N, eps = add_norm
        if silu or h_B_N.stride(1) != 1:
            raise ValueError("gemv add_norm: a plain projection and a unit-stride residual expected")
        k["gemv_reduce_add_norm"][(B,)](part, bias, h_B_N, weight_N, out_B_N, N, eps, h_B_N.stride(0), BP=BP,
                                        BLOCK=_next_pow2(N), SPLIT=split, HAS_BIAS=b_X is not None,
                                        **_launch(pdl))
        return h_B_N, out_B_N
    if split > 1:
        k["gemv_reduce"][(-(-N // 64),)](part, bias, out_B_N, B, N, BP=BP, BLOCK_N=64, SPLIT=split,
                                         HAS_BIAS=b_X is not None, SILU=silu, num_warps=4, **_launch(pdl))
    return out_B_N if add_norm is None else add_rms_norm(add_norm[0], out_B_N, add_norm[1], add_norm[2], pdl)


def linear(x_B_K, w_N_K, b_N, config=None, pdl: bool = False) -> torch.Tensor:
    """``linear_ref`` as ``gemv_launch``'s kernel(s)."""
    return gemv_launch(x_B_K, w_N_K, b_N, w_N_K.shape[0], False, config, pdl=pdl)


def linear_silu(x_B_K, w_2I_K, b_2I, config=None, pdl: bool = False) -> torch.Tensor:
    """``linear_silu_ref`` as ``gemv_launch``'s kernel(s): the gate/up projection and silu * up in one pass."""
    return gemv_launch(x_B_K, w_2I_K, b_2I, w_2I_K.shape[0] // 2, True, config, pdl=pdl)


def linear_add_rms_norm(x_B_K, w_N_K, b_N, h_B_N, weight_N, eps: float, config=None, pdl: bool = False):
    """``add_rms_norm_ref(h, linear_ref(x, w, b), weight, eps)`` as ``gemv_launch``'s kernels: (h, normed), h
    updated in place. Split over its inputs: 2 kernels (the projection's partials; their sum, the add and the
    norm), else 2 (the projection; ``add_rms_norm``)."""
    return gemv_launch(x_B_K, w_N_K, b_N, w_N_K.shape[0], False, config, add_norm=(h_B_N, weight_N, eps), pdl=pdl)


def linear_add_rms_norm_ref(x_B_K, w_N_K, b_N, h_B_N, weight_N, eps: float):
    """``add_rms_norm_ref`` of h and ``linear_ref(x, w, b)``: (h, normed), h updated in place."""
    return add_rms_norm_ref(h_B_N, linear_ref(x_B_K, w_N_K, b_N), weight_N, eps)

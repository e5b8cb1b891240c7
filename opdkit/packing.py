"""Rows scored as one packed sequence (``runtime.unpadded_rows``): each row's real tokens, pads
removed, one after another, attention causal within each row only (variable-length flash attention).

The scorer's forward of a step (the student's with gradients, the teacher's without) over B rows of
prompt + completion computes, for each row alone, the hidden states of its real tokens at positions
0..n_b-1 (``scoring.completion_hidden``'s unpadded mode, which ran each row as a forward of its own).
Packed, the rows are one forward: the same kernels for every layer once per step instead of once per
row (at 1,024 new tokens a row's kernels are too small to keep the GPU busy: the per-row forward is
bound by launching them), no padding computed, no S x S mask.

Attention (``varlen_attention``, registered with transformers' attention interface as ``ATTN``) is
``torch.nn.attention.varlen.varlen_attn`` (FlashAttention over the rows' cumulative lengths) on CUDA;
elsewhere, or without it, each row's causal sdpa in turn (the same values, used by the CPU tests). The
row boundaries reach it as the ``cu_seq_lens_q`` / ``max_length_q`` keywords that transformers'
models pass through to the attention function (the names its flash-attention path uses). A model
scored packed keeps ``ATTN`` as its attention implementation from then on (gradient checkpointing
recomputes its layers later, outside this module's calls); any other forward of it (no row
boundaries) goes to sdpa as before, with sdpa's masks. Only models on sdpa are packed.
"""

from __future__ import annotations

import importlib.util
import inspect

import torch

ATTN = "opdkit_varlen"


def _varlen_fn():
    """torch's variable-length FlashAttention (``torch.nn.attention.varlen.varlen_attn``), or None."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return None
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def varlen_available(device: torch.device) -> bool:
    """Packed rows run with FlashAttention here (CUDA with torch's varlen attention)."""
    return device.type == "cuda" and _varlen_fn() is not None


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                     max_length_q=None, **kwargs):
    """transformers attention interface for packed rows: query (1, H, N, D), key/value (1, K, N, D), the
    rows' boundaries ``cu_seq_lens_q`` (R + 1,) int32; each token attends causally within its row.
    Returns ((1, N, H, D), None)."""
    if cu_seq_lens_q is None:  # not a packed forward: sdpa, as the model attended before packing
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    q_N_H_D, k_N_K_D, v_N_K_D = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    H, K = q_N_H_D.shape[1], k_N_K_D.shape[1]
    fn = _varlen_fn() if query.device.type == "cuda" else None
    half = (torch.float16, torch.bfloat16)
    if torch.is_autocast_enabled("cuda") and query.device.type == "cuda":
        dtype = torch.get_autocast_dtype("cuda")  # as autocast runs sdpa: q, k (fp32 after rotary) and v in it
    else:
        dtype = value.dtype if value.dtype in half else None  # FlashAttention runs in fp16 / bf16 only
    if fn is not None and dtype is not None:
        q_N_H_D, k_N_K_D, v_N_K_D = q_N_H_D.to(dtype), k_N_K_D.to(dtype), v_N_K_D.to(dtype)
        params = inspect.signature(fn).parameters
        kw = {"scale": scaling}
        if "window_size" in params:
            kw["window_size"] = (-1, 0)  # causal
        else:
            kw["is_causal"] = True
        if H != K and "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif H != K:
            k_N_K_D, v_N_K_D = k_N_K_D.repeat_interleave(H // K, dim=1), v_N_K_D.repeat_interleave(H // K, dim=1)
        out_N_H_D = fn(q_N_H_D.contiguous(), k_N_K_D.contiguous(), v_N_K_D.contiguous(), cu_seq_lens_q, cu_seq_lens_q,
                       int(max_length_q), int(max_length_q), **kw)
        return out_N_H_D[None], None
    return _rows_sdpa(q_N_H_D, k_N_K_D, v_N_K_D, cu_seq_lens_q, scaling)  # (CPU, float32, no varlen attention)


def _rows_sdpa(q_N_H_D, k_N_K_D, v_N_K_D, cu_seq_lens_q, scaling):
    """Each row's causal sdpa in turn: q (N, H, D), k / v (N, K, D), rows at ``cu_seq_lens_q``. ((1, N, H, D), None)."""
    H, K = q_N_H_D.shape[1], k_N_K_D.shape[1]
    outs = []
    bounds = cu_seq_lens_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        q_1_H_n_D = q_N_H_D[a:b].transpose(0, 1)[None]  # 4-D: sdpa's fused kernels take no 3-D inputs (math then)
        k_1_H_n_D = k_N_K_D[a:b].transpose(0, 1).repeat_interleave(H // K, dim=0)[None]
        v_1_H_n_D = v_N_K_D[a:b].transpose(0, 1).repeat_interleave(H // K, dim=0)[None]
        o_1_H_n_D = torch.nn.functional.scaled_dot_product_attention(q_1_H_n_D, k_1_H_n_D, v_1_H_n_D, is_causal=True,
                                                                     scale=scaling)
        outs.append(o_1_H_n_D[0].transpose(0, 1))
    return torch.cat(outs)[None], None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTN, varlen_attention)
        AttentionMaskInterface.register(ATTN, sdpa_mask)  # forwards without row boundaries: sdpa's masks
        _registered = True


def can_pack(decoder) -> bool:
    """``decoder`` attends through sdpa (or already through ``ATTN``): its rows can be packed."""
    return decoder.config._attn_implementation in ("sdpa", ATTN)


def packed_hidden(decoder, input_ids_B_S, attention_mask_B_S, prompt_width: int, completion_len: int):
    """Final hidden states (B, T, H) at the columns that predict each row's completion tokens (zeros past
    a row's completion), every row run alone at positions 0..n_b-1, as one packed forward of ``decoder``
    (the base model under the LM head). Rows: ``[prompt (width Sp)][completion (width T)]`` with real
    tokens contiguous within each part and the completion's first (as rollouts are laid out)."""
    B, S = input_ids_B_S.shape
    Sp, T = prompt_width, completion_len
    keep_B_S = attention_mask_B_S.bool()
    n_prompt_B, n_comp_B = keep_B_S[:, :Sp].sum(1), keep_B_S[:, Sp:].sum(1)
    cols_T = torch.arange(T, device=keep_B_S.device)
    if not torch.equal(keep_B_S[:, Sp:], cols_T[None, :] < n_comp_B[:, None]):
        raise ValueError("completion mask has a gap; unpadded scoring needs real tokens first")
    n_B = n_prompt_B + n_comp_B
    ids_N = input_ids_B_S[keep_B_S]  # row after row, pads removed
    cu_R1 = torch.zeros(B + 1, dtype=torch.int32, device=ids_N.device)
    cu_R1[1:] = n_B.cumsum(0)
    start_N = torch.repeat_interleave(cu_R1[:-1].long(), n_B)  # each token's row start
    pos_1_N = (torch.arange(ids_N.shape[0], device=ids_N.device) - start_N)[None]
    _register()
    decoder.config._attn_implementation = ATTN  # kept: a checkpointed layer's recompute attends packed too
    no_mask_1_1_1_1 = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=ids_N.device)  # 4-D: transformers builds none
    h_1_N_H = decoder(input_ids=ids_N[None], attention_mask=no_mask_1_1_1_1, position_ids=pos_1_N, use_cache=False,
                      cu_seq_lens_q=cu_R1, cu_seq_lens_k=cu_R1, max_length_q=int(n_B.max()),
                      max_length_k=int(n_B.max())).last_hidden_state
    N = ids_N.shape[0]
    # the column predicting completion token t of row b: packed index cu_b + n_prompt_b - 1 + t; past the
    # completion, a zero row appended at index N
    idx_B_T = cu_R1[:-1, None].long() + n_prompt_B[:, None] - 1 + cols_T[None, :]
    idx_B_T = torch.where(cols_T[None, :] < n_comp_B[:, None], idx_B_T, torch.full_like(idx_B_T, N))
    h_N1_H = torch.cat([h_1_N_H[0], h_1_N_H.new_zeros((1, h_1_N_H.shape[-1]))])
    return h_N1_H[idx_B_T]

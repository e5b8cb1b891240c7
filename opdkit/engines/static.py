"""Static-KV-cache decoding on a bf16 inference copy of the policy, replayed as CUDA graphs.

Why not ``model.generate`` on the GPU: on fp32 master weights under autocast every weight is
re-cast for every token; each token runs ~30 layers of Python; and with a static cache HF's sdpa
path repeats each grouped K/V head over the whole cache length at every step. Here:

- ``StaticDecoder`` keeps a bf16 copy of the policy (LoRA merged in), refreshed from the live
  model with ``sync`` (device copies only: milliseconds);
- prompts (left-padded, width Sp) are prefilled once into an HF ``StaticCache``: slots 0..Sp-1;
  completion token t is fed at slot Sp+t with position n_prompt+t, the geometry that
  ``teacher.build_geometry`` scores;
- one decode step (forward, sampling, bookkeeping, all state in device tensors) is captured as a
  CUDA graph per bucket of cache length (attention reads only the first ``bucket`` slots, so
  early tokens do not pay for the whole cache) and replayed: no Python per token;
- attention for one query token (``_attention``) multiplies each K/V head once with its whole
  group of query heads (grouped-query attention without repeating K/V);
- for Llama/Qwen2/Qwen3-type layers the per-token forward (``_layer_step``) is written out with
  few kernels: q/k/v and gate/up as one matmul each (the copy's weights are views into fused
  buffers), rotary as one small batched matmul each for q and k by the step's rotation matrix
  (``rotation``: cos on the diagonal, ±sin where rotate_half moves an entry; built once per step
  for all layers), the attention scale and mask as one add, the residual adds inside the
  projections' matmuls (addmm), the fused RMSNorm, and the cache slot from the step's token index
  (no per-layer counter to advance). A replayed step is bound by its number of small kernels
  (each costs microseconds however small), not by the weight reads: this halves it against the
  modules' own forward, which is still used for other architectures.

Sampling and the recorded log-probs are ``sampling.policy_scores``, as in the ``generate`` path:
a sample depends only on its seed and the logits, and its log-prob is log π of the policy it was
drawn from (tempered, top-p-truncated, over the tokenizer's ids). Off CUDA (or
``use_graphs=False``) the same steps run eagerly, which is how the CPU tests check this path
against ``generate``.
"""

from __future__ import annotations

import copy
import inspect

import torch

from opdkit.engines.sampling import policy_scores
from opdkit.engines.weights import merged_weights, plain

ATTN_NAME = "opdkit_static"


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention interface. query (B, H, q, D); key/value (B, Hkv, L, D) = the whole static
    cache; attention_mask bool (B, 1, q, n), True = visible: only the first n cache slots are read
    (the decoder passes n = the current bucket). Returns ((B, q, H, D), None)."""
    B, H, q, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv  # query heads per K/V head; head h reads K/V head h // G
    n = attention_mask.shape[-1]
    key, value = key[:, :, :n], value[:, :, :n]
    scale = D ** -0.5 if scaling is None else scaling
    if q == 1:  # decode: the G query heads of one K/V head become G query rows of that head
        q_B_K_G_D = query.reshape(B, Hkv, G, D)
        scores_B_K_G_n = torch.matmul(q_B_K_G_D, key.transpose(-1, -2)).float() * scale
        scores_B_K_G_n = scores_B_K_G_n.masked_fill(~attention_mask, float("-inf"))  # (B, 1, 1, n) broadcasts
        out_B_K_G_D = torch.matmul(scores_B_K_G_n.softmax(-1).to(value.dtype), value)
        return out_B_K_G_D.reshape(B, H, 1, D).transpose(1, 2), None
    key = key.repeat_interleave(G, dim=1)  # prefill (once per call): plain sdpa on repeated heads
    value = value.repeat_interleave(G, dim=1)
    out_B_H_q_D = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale)
    return out_B_H_q_D.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)


def inference_copy(model, dtype: torch.dtype = torch.bfloat16):
    """A frozen ``dtype`` copy of ``model`` (a peft model gives its base architecture), using the
    static-cache attention above; weights are filled by ``sync_weights``."""
    from transformers import AutoModelForCausalLM

    _register_attention()
    base = plain(model)
    device = next(base.parameters()).device
    with torch.device(device):
        gen = AutoModelForCausalLM.from_config(copy.deepcopy(base.config), dtype=dtype)
    gen.config._attn_implementation = ATTN_NAME  # read by every attention module at call time
    gen.eval().requires_grad_(False)
    sync_weights(gen, model)
    return gen


@torch.no_grad()
def sync_weights(gen, model) -> None:
    """Copy ``model``'s ``merged_weights`` (LoRA folded in) into ``gen``, cast to gen's dtype."""
    dst = dict(gen.named_parameters(remove_duplicate=False))
    done = set()
    for key, src in merged_weights(model):
        if key not in dst:
            if key in dict(gen.named_buffers()):
                continue  # a persistent buffer: the copy computes its own
            raise ValueError(f"inference copy has no parameter {key!r}")
        dst[key].copy_(src)
        done.add(key)
    missing = set(dst) - done
    if missing:
        raise ValueError(f"inference copy: no source for {sorted(missing)[:5]}")


def _rms(x, norm):
    """HF Llama/Qwen RMSNorm (fp32 statistics) as one fused op."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _fuse(linears: list):
    """One weight (and bias) holding ``linears``' rows; each module's parameters become views of it,
    so ``sync_weights`` keeps the fused buffer current with no second copy."""
    w = torch.cat([m.weight.data for m in linears])
    b = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None
    at = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = w[at:at + n]
        if b is not None:
            m.bias.data = b[at:at + n]
        at += n
    return w, b


def _fused_layers(gen) -> list[dict] | None:
    """Per-layer fused weights for Llama/Qwen2/Qwen3-type decoders; None for other architectures."""
    cfg, m = gen.config, gen.model
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"])):
        return None
    out = []
    for layer in m.layers:
        a, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        need = [(a, "q_proj"), (a, "k_proj"), (a, "v_proj"), (a, "o_proj"), (mlp, "gate_proj"), (mlp, "up_proj"),
                (mlp, "down_proj"), (mlp, "act_fn"), (layer, "input_layernorm"), (layer, "post_attention_layernorm")]
        if any(o is None or not hasattr(o, k) for o, k in need) or not hasattr(layer.input_layernorm, "variance_epsilon"):
            return None  # e.g. Gemma's (1 + weight) norms keep their eps elsewhere: the modules' forward is used
        w_qkv, b_qkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
        w_gu, b_gu = _fuse([mlp.gate_proj, mlp.up_proj])
        out.append(dict(w_qkv=w_qkv, b_qkv=b_qkv, w_gu=w_gu, b_gu=b_gu, attn=a, mlp=mlp, ln1=layer.input_layernorm,
                        ln2=layer.post_attention_layernorm, q_norm=getattr(a, "q_norm", None), k_norm=getattr(a, "k_norm", None),
                        H=cfg.num_attention_heads, Hkv=cfg.num_key_value_heads, D=a.head_dim, scale=a.scaling))
    return out


def _linear_add(x_B_I, linear, residual_B_H):
    """``residual + linear(x)`` as one matmul when the projection has no bias (addmm's beta=1 term)."""
    if linear.bias is not None:
        return residual_B_H + torch.nn.functional.linear(x_B_I, linear.weight, linear.bias)
    return torch.addmm(residual_B_H, x_B_I, linear.weight.t())


def half_turn(D: int, dtype: torch.dtype, device) -> torch.Tensor:
    """P_D_D with x @ P == rotate_half(x) = cat(-x2, x1) for row vectors x of size D:
    P[j + D/2, j] = -1 and P[j, j + D/2] = 1 for j < D/2, 0 elsewhere."""
    half = D // 2
    P_D_D = torch.zeros((D, D), dtype=dtype, device=device)
    idx = torch.arange(half, device=device)
    P_D_D[idx + half, idx] = -1
    P_D_D[idx, idx + half] = 1
    return P_D_D


def rotation(cos_B_1_D, sin_B_1_D, P_D_D) -> torch.Tensor:
    """The rotary embedding of one position per row as a matrix R_B_D_D: x @ R == x * cos +
    rotate_half(x) * sin for row vectors x, i.e. R = diag(cos) + P diag(sin) (``half_turn``):
    two products per entry of x @ R, every other term an exact zero."""
    B, D = cos_B_1_D.shape[0], cos_B_1_D.shape[-1]
    return torch.diag_embed(cos_B_1_D.view(B, D)) + P_D_D * sin_B_1_D.view(B, 1, D)


def _layer_step(f: dict, h_B_H, rot_B_D_D, slot_1, bias_B_1_1_n, keys_B_K_L_D, values_B_K_L_D):
    """One decoder layer for one new token per row: the HF Llama/Qwen layer in fewer kernels.

    ``rot_B_D_D``: each row's rotary embedding as a matrix (``rotation``), shared by all layers.
    ``slot_1``: the cache slot of the new token. ``bias_B_1_1_n`` is the additive fp32 attention
    mask (0 visible, -inf hidden), shared by all layers.
    """
    B, H, Hkv, D = h_B_H.shape[0], f["H"], f["Hkv"], f["D"]
    G, n = H // Hkv, bias_B_1_1_n.shape[-1]
    qkv_B_X = torch.nn.functional.linear(_rms(h_B_H, f["ln1"]), f["w_qkv"], f["b_qkv"])
    q_B_H_D = qkv_B_X[:, :H * D].view(B, H, D)
    k_B_K_D = qkv_B_X[:, H * D:(H + Hkv) * D].view(B, Hkv, D)
    v_B_K_D = qkv_B_X[:, (H + Hkv) * D:].view(B, Hkv, D)
    if f["q_norm"] is not None:  # Qwen3: RMSNorm per head before rotary
        q_B_H_D, k_B_K_D = _rms(q_B_H_D, f["q_norm"]), _rms(k_B_K_D, f["k_norm"])
    q_B_H_D = torch.bmm(q_B_H_D, rot_B_D_D)  # rotary; contiguous, so the grouped view below is free
    k_B_K_D = torch.bmm(k_B_K_D, rot_B_D_D)
    keys_B_K_L_D.index_copy_(2, slot_1, k_B_K_D[:, :, None, :])
    values_B_K_L_D.index_copy_(2, slot_1, v_B_K_D[:, :, None, :])
    q_B_K_G_D = q_B_H_D.view(B, Hkv, G, D)  # head h reads K/V head h // G
    scores_B_K_G_n = torch.matmul(q_B_K_G_D, keys_B_K_L_D[:, :, :n].transpose(-1, -2))
    scores_B_K_G_n = torch.add(bias_B_1_1_n, scores_B_K_G_n, alpha=f["scale"])  # fp32: scale and mask in one kernel
    probs_B_K_G_n = scores_B_K_G_n.softmax(-1).to(h_B_H.dtype)
    o_B_X = torch.matmul(probs_B_K_G_n, values_B_K_L_D[:, :, :n]).reshape(B, H * D)
    h_B_H = _linear_add(o_B_X, f["attn"].o_proj, h_B_H)
    gu_B_X = torch.nn.functional.linear(_rms(h_B_H, f["ln2"]), f["w_gu"], f["b_gu"])
    gate_B_I, up_B_I = gu_B_X.chunk(2, dim=-1)
    mlp = f["mlp"]
    return _linear_add(mlp.act_fn(gate_B_I) * up_B_I, mlp.down_proj, h_B_H)


class StaticDecoder:
    """Sampling with a static KV cache on a bf16 copy of the policy (see the module docstring)."""

    def __init__(self, model, *, dtype: torch.dtype = torch.bfloat16, bucket: int = 512, use_graphs: bool | None = None,
                 fused: bool = True, n_vocab: int | None = None):
        self.gen = inference_copy(model, dtype)
        self.n_vocab = n_vocab  # sample ids < n_vocab only (None: every row of the head)
        self.device = next(self.gen.parameters()).device
        self.bucket = bucket
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        params = inspect.signature(self.gen.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        self.layers = _fused_layers(self.gen) if fused else None  # None: use the modules' own forward for this architecture
        if self.layers is not None:
            self.half_turn_D_D = half_turn(self.layers[0]["D"], dtype, self.device)
        self.stats: dict = {}

    def _forward(self, tok_B, pos_B, mask_B_1_1_n, cache, slot_1):
        """Raw next-token logits (B, V) fp32 after feeding one token per row through the cache at
        slot ``slot_1`` (a 1-element device tensor; the modules' own forward advances the cache's
        counters instead)."""
        m = self.gen.model
        if self.layers is None:
            h_B_1_H = m(input_ids=tok_B[:, None], attention_mask=mask_B_1_1_n, position_ids=pos_B[:, None],
                        use_cache=True, **{self.cache_kw: cache}).last_hidden_state
            return self.gen.lm_head(h_B_1_H[:, -1]).float()
        h_B_H = m.embed_tokens(tok_B)
        cos_B_1_D, sin_B_1_D = m.rotary_emb(h_B_H, pos_B[:, None])  # of each row's position
        rot_B_D_D = rotation(cos_B_1_D, sin_B_1_D, self.half_turn_D_D)
        bias_B_1_1_n = torch.zeros(mask_B_1_1_n.shape, dtype=torch.float32, device=tok_B.device).masked_fill_(
            ~mask_B_1_1_n, float("-inf"))
        for f, layer in zip(self.layers, cache.layers):  # every layer writes the same slot
            h_B_H = _layer_step(f, h_B_H, rot_B_D_D, slot_1, bias_B_1_1_n, layer.keys, layer.values)
        return self.gen.lm_head(_rms(h_B_H, m.norm)).float()

    def sync(self, model) -> None:
        sync_weights(self.gen, model)

    @torch.no_grad()
    def generate(self, ids_B_Sp, mask_B_Sp, seeds: list[int], *, temperature: float, top_p: float,
                 max_new_tokens: int, eos_ids: list[int], check_every: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled tokens (B, T) and their log-probs under the sampling policy (B, T); T <= max_new_tokens (stops
        once every row has emitted an EOS, checked every ``check_every`` tokens)."""
        from transformers import StaticCache

        with torch.autocast(self.device.type, enabled=False):
            B, Sp = ids_B_Sp.shape
            T = max_new_tokens
            L = Sp + T
            dev = self.device
            decoder, head = self.gen.model, self.gen.lm_head
            cache = StaticCache(config=self.gen.config, max_cache_len=L)
            seeds_B = torch.tensor(seeds, dtype=torch.int64, device=dev)
            eos_E = torch.tensor(eos_ids, dtype=torch.int64, device=dev)
            out_ids_B_T = torch.zeros((B, T), dtype=torch.int64, device=dev)
            out_logp_B_T = torch.zeros((B, T), dtype=torch.float32, device=dev)
            visible_B_L = torch.zeros((B, L), dtype=torch.bool, device=dev)  # cache slots holding real tokens
            visible_B_L[:, :Sp] = mask_B_Sp.bool()

            # prefill: causal over the prompt, pads hidden from real tokens; each query sees itself (no empty row)
            causal_Sp_Sp = torch.ones((Sp, Sp), dtype=torch.bool, device=dev).tril()
            mask_B_1_Sp_Sp = (visible_B_L[:, None, None, :Sp] & causal_Sp_Sp) | torch.eye(Sp, dtype=torch.bool, device=dev)
            pos_B_Sp = (mask_B_Sp.long().cumsum(1) - 1).clamp_min(0)
            h_B_Sp_H = decoder(input_ids=ids_B_Sp, attention_mask=mask_B_1_Sp_Sp, position_ids=pos_B_Sp,
                               use_cache=True, **{self.cache_kw: cache}).last_hidden_state
            t_dev = torch.zeros((), dtype=torch.int64, device=dev)  # index of the token being sampled
            scores_B_V, logp_B_V = policy_scores(head(h_B_Sp_H[:, -1]).float(), seeds_B, t_dev, temperature, top_p,
                                                 self.n_vocab)
            tok_B = scores_B_V.argmax(-1)
            out_ids_B_T[:, 0] = tok_B
            out_logp_B_T[:, 0] = logp_B_V.gather(1, tok_B[:, None])[:, 0]
            done_B = torch.isin(tok_B, eos_E)
            pos_B = mask_B_Sp.long().sum(1)  # position of token 0 = number of real prompt tokens
            t_dev += 1

            def step(n: int):
                """Feed token t-1 (slot Sp-1+t), sample token t, attending to slots < n; device tensors only."""
                slot_1 = (t_dev + (Sp - 1)).view(1)
                visible_B_L.index_fill_(1, slot_1, True)
                raw_B_V = self._forward(tok_B, pos_B, visible_B_L[:, None, None, :n], cache, slot_1)
                scores_B_V, logp_B_V = policy_scores(raw_B_V, seeds_B, t_dev, temperature, top_p, self.n_vocab)
                new_B = scores_B_V.argmax(-1)
                logp_B = logp_B_V.gather(1, new_B[:, None])[:, 0]
                out_ids_B_T.index_copy_(1, t_dev.view(1), new_B[:, None])
                out_logp_B_T.index_copy_(1, t_dev.view(1), logp_B[:, None])
                done_B.logical_or_(torch.isin(new_B, eos_E))
                tok_B.copy_(new_B)
                pos_B.add_(1)
                t_dev.add_(1)

            graphs: dict[int, torch.cuda.CUDAGraph] = {}
            pool, t, prev_n = None, 1, 0
            while t < T:
                n = min(L, -(-(Sp + t) // self.bucket) * self.bucket)  # slots 0..Sp-1+t must be visible
                if not self.use_graphs:
                    step(n)
                elif n not in graphs and n != prev_n:
                    # first token of a bucket: run eagerly on a side stream (warms cuBLAS, allocator) ...
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        step(n)
                    torch.cuda.current_stream().wait_stream(side)
                else:
                    if n not in graphs:  # ... then capture it (recorded, not run) and replay from here on
                        g = torch.cuda.CUDAGraph()
                        # thread_local: another thread (the trainer, under rollout.overlap) may use CUDA meanwhile
                        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                            step(n)
                        pool = g.pool()
                        graphs[n] = g
                    graphs[n].replay()
                prev_n = n
                t += 1
                if t % check_every == 0 and bool(done_B.all()):
                    break
            self.stats = {"decode_steps": t, "graphs": len(graphs), "bucket": self.bucket, "fused_layers": self.layers is not None}
            del graphs
            return out_ids_B_T[:, :t], out_logp_B_T[:, :t]

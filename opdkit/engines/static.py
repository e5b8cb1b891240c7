"""Static-KV-cache decoding on a bf16 inference copy of the policy, replayed as CUDA graphs.

Why not ``model.generate`` on the GPU: on fp32 master weights under autocast every weight is
re-cast for every token; each token runs ~30 layers of Python; and with a static cache HF's sdpa
path repeats each grouped K/V head over the whole cache length at every step. Here:

- ``StaticDecoder`` keeps a bf16 copy of the policy (LoRA merged in), refreshed from the live
  model with ``sync`` (device copies only: milliseconds);
- for Llama/Qwen2/Qwen3-type layers (``_fused_layers``) the decoder owns its KV cache: prompts
  (left-padded, width W) are prefilled into slots Sp-W..Sp-1 of a cache of Sp + T + S slots
  (Sp: the prompt slots of the session, W rounded up; a later call with prompts up to Sp reuses
  it); completion token t is fed at slot Sp+t-1 with position n_prompt+t-1, the geometry that
  ``scoring.build_geometry`` scores;
- one decode step reads every varying value (token index, positions, the visible span
  ``start_b <= slot < Sp + t``) from device tensors, so its shapes never change: S steps
  (``steps_per_graph``) are captured as one CUDA graph, once per session, and replayed; the host
  checks for EOS every ``check_every`` tokens and asks ``should_stop`` between replays;
- per layer a step is eight kernels on CUDA (``engines.decode_kernels``): the q/k/v projection
  (fused weights: the copy's q/k/v and gate/up weights are views into one buffer each), rotary
  embedding + KV-cache write + split-length attention over the visible slots, its merge, the
  output projection, the residual add + RMSNorm (HF's rounding), the gate/up projection with
  silu * up, the down projection (split over its inputs), its parts summed in order + the residual
  add + the next RMSNorm; at up to 16 rows the projections are the kit's GEMV kernels
  (``gemv`` / ``rollout.decode_gemv``; else cuBLAS and a separate silu * up; the norms stay their own
  kernels: folded into the projections, each program re-reading the rows before streaming its weights,
  the step measured 9% slower on an H200); sampling is
  two kernels (``decode_kernels.sample_token``): the hashing Gumbel-argmax and the log-softmax's parts over
  blocks of ids, then their merge with the step's writes (the id, its log π, the next input, the position,
  the end test); at top-p < 1 after the nucleus search (5 kernels: a histogram of the bf16 logits' sort keys
  gives the nucleus's last key, its ties cut in id order), not the torch sampler's float64 sort of every row. On Hopper
  and later the kernels are launched with programmatic dependent launch (``decode_kernels.pdl_available``): each one's
  launch overlaps the kernel before it, and every kernel waits for that one to finish before its first store
  and before it reads anything an earlier kernel wrote, so no result changes (``pdl=False`` launches them
  one after the other).

Other architectures (e.g. Gemma's norms) decode through the modules' own forward with an HF
``StaticCache``, one CUDA graph per bucket of cache length (``_ModuleDecoder``).

Sampling and the recorded log-probs are ``sampling.policy_scores``, as in the ``generate`` path:
a sample depends only on its seed and the logits (the Gumbel kernel computes the same float64
scores, bit for bit, as ``policy_scores``), and its log-prob is log π of the policy it was drawn
from (tempered, top-p-truncated, over the tokenizer's ids). The fused kernels round differently
from the modules' forward (attention in float32 throughout, one rounding of the rotary
embedding), so the logits, and so rare samples, differ at bf16 rounding from HF's forward; the
recorded log-probs are those of the logits actually sampled from, and the update's alignment check
bounds the difference. Off CUDA (or ``use_graphs=False``) the same steps run eagerly with the
kernels' torch references, which is how the CPU tests check this path against ``generate``.
"""

from __future__ import annotations

import copy
import inspect
import time

import torch

from opdkit import interrupt
from opdkit.engines import decode_kernels as dk
from opdkit.engines.sampling import mask_vocab, policy_scores
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
    out_B_H_q_D = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                                   scale=scale)
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
        if (any(o is None or not hasattr(o, k) for o, k in need)
                or not hasattr(layer.input_layernorm, "variance_epsilon")):
            return None  # e.g. Gemma's (1 + weight) norms keep their eps elsewhere: the modules' forward is used
        w_qkv, b_qkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
        w_gu, b_gu = _fuse([mlp.gate_proj, mlp.up_proj])
        out.append(dict(w_qkv=w_qkv, b_qkv=b_qkv, w_gu=w_gu, b_gu=b_gu, attn=a, mlp=mlp, ln1=layer.input_layernorm,
                        ln2=layer.post_attention_layernorm, q_norm=getattr(a, "q_norm", None),
                        k_norm=getattr(a, "k_norm", None),
                        H=cfg.num_attention_heads, Hkv=cfg.num_key_value_heads, D=a.head_dim, scale=a.scaling))
    return out


def _rotate_half_apply(x_B_N_W_D, cos_B_W_D, sin_B_W_D):
    """HF's ``apply_rotary_pos_emb`` for one tensor (heads on axis 1), in x's dtype."""
    half = x_B_N_W_D.shape[-1] // 2
    rot = torch.cat((-x_B_N_W_D[..., half:], x_B_N_W_D[..., :half]), dim=-1)
    return x_B_N_W_D * cos_B_W_D[:, None] + rot * sin_B_W_D[:, None]


class _Session:
    """The buffers (KV cache, rotary table, step state, kernel partials) and the captured graph of
    one decode shape: B rows, Sp prompt slots, up to T new tokens, one sampling setting."""

    def __init__(self, dec: StaticDecoder, B: int, Sp: int, T: int, temperature: float, top_p: float,
                 eos_ids: list[int]):
        f0, dev, dt = dec.layers[0], dec.device, dec.dtype
        H, K, D = f0["H"], f0["Hkv"], f0["D"]
        S = dec.steps_per_graph
        self.key = (B, T, temperature, top_p, tuple(eos_ids))
        self.B, self.Sp, self.T, self.L = B, Sp, T, Sp + T + S
        self.temperature, self.top_p = temperature, top_p
        self.keys = [torch.zeros((B, K, self.L, D), dtype=dt, device=dev) for _ in dec.layers]
        self.values = [torch.zeros((B, K, self.L, D), dtype=dt, device=dev) for _ in dec.layers]
        pos_1_L = torch.arange(self.L, device=dev)[None]
        cos_1_L_D, sin_1_L_D = dec.gen.model.rotary_emb(torch.zeros((), dtype=dt, device=dev), pos_1_L)  # HF's values
        self.cos_L_D, self.sin_L_D = cos_1_L_D[0].contiguous(), sin_1_L_D[0].contiguous()
        self.tok_B = torch.zeros(B, dtype=torch.int64, device=dev)
        self.pos_B = torch.zeros(B, dtype=torch.int64, device=dev)
        self.start_B = torch.zeros(B, dtype=torch.int64, device=dev)  # first visible slot of each row
        self.seeds_B = torch.zeros(B, dtype=torch.int64, device=dev)
        self.t_1 = torch.zeros(1, dtype=torch.int64, device=dev)  # index of the token being sampled
        self.done_B = torch.zeros(B, dtype=torch.bool, device=dev)
        self.eos_E = torch.tensor(eos_ids, dtype=torch.int64, device=dev)
        self.out_ids_B_T = torch.zeros((B, T + S), dtype=torch.int64, device=dev)
        self.out_logp_B_T = torch.zeros((B, T + S), dtype=torch.float32, device=dev)
        self.kernels = dec.kernels
        self.gemv = dec.kernels and dec.gemv and B <= dk.GEMV_MAX_ROWS
        self.pdl = dec.kernels and dec.pdl  # each kernel's launch overlaps the one before (no result changes)
        if dec.kernels:
            self.attn_plan = dk.AttentionPlan(B, H, K, D, self.L, dev, pdl=self.pdl)
            kernel_sampling = temperature > 0 and (top_p >= 1.0 or dt in (torch.bfloat16, torch.float16))
            self.gumbel_plan = (dk.GumbelPlan(B, dec.vocab, temperature, dev, pdl=self.pdl, top_p=top_p)
                                if kernel_sampling else None)  # else (greedy; top-p < 1 in float32) the torch sampler
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool = None

    def fits(self, B: int, W: int, T: int, temperature: float, top_p: float, eos_ids: list[int]) -> bool:
        return (B, T, temperature, top_p, tuple(eos_ids)) == self.key and W <= self.Sp


class StaticDecoder:
    """Sampling with a static KV cache on a bf16 copy of the policy (see the module docstring)."""

    def __init__(self, model, *, dtype: torch.dtype = torch.bfloat16, bucket: int = 512, use_graphs: bool | None = None,
                 fused: bool = True, n_vocab: int | None = None, kernels: bool | None = None, steps_per_graph: int = 16,
                 prompt_slots: int = 256, gemv: bool = True, pdl: bool = True):
        self.gen = inference_copy(model, dtype)
        self.dtype = dtype
        self.n_vocab = n_vocab  # sample ids < n_vocab only (None: every row of the head)
        self.device = next(self.gen.parameters()).device
        self.vocab = n_vocab or self.gen.lm_head.weight.shape[0]
        self.bucket = bucket  # the modules' path: cache-length bucket of one graph
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.layers = _fused_layers(self.gen) if fused else None  # None: the modules' own forward
        # the Triton kernels (engines.decode_kernels) on CUDA where Triton is installed; else their references
        self.kernels = (self.device.type == "cuda" and dk.available()) if kernels is None else kernels
        self.silu = getattr(self.gen.config, "hidden_act", None) == "silu"
        self.gemv = gemv  # with the kernels, at <= dk.GEMV_MAX_ROWS rows: the projections as the kit's GEMV kernels
        # with the kernels: launched with programmatic dependent launch where the device and Triton allow it
        self.pdl = pdl and dk.pdl_available(self.device)
        self.steps_per_graph, self.prompt_slots = steps_per_graph, prompt_slots
        self.session: _Session | None = None
        self.modules = _ModuleDecoder(self) if self.layers is None else None
        self.stats: dict = {}

    def sync(self, model) -> None:
        sync_weights(self.gen, model)

    # --- one decode step, device tensors only ---------------------------------------------------

    def _norm(self, s: _Session, x_B_H, norm):
        """HF's RMSNorm of ``x`` (one kernel on CUDA)."""
        if s.kernels:
            return dk.rms_norm(x_B_H, norm.weight, norm.variance_epsilon, s.pdl)
        return dk.rms_norm_ref(x_B_H, norm.weight, norm.variance_epsilon)

    def _add_norm(self, s: _Session, h_B_H, r_B_H, norm):
        """The residual add ``h += r`` (in place) and HF's RMSNorm of the sum: (h, normed)."""
        if s.kernels:
            return dk.add_rms_norm(h_B_H, r_B_H, norm.weight, norm.variance_epsilon, s.pdl)
        return dk.add_rms_norm_ref(h_B_H, r_B_H, norm.weight, norm.variance_epsilon)

    def _attend(self, s: _Session, i: int, f: dict, qkv_B_X):
        """Layer ``i``'s attention for one token per row from its q/k/v projection: the rotary embedding, the
        token's k/v written into the cache, attention over the visible slots: (B, H, D)."""
        B, H, K, D = qkv_B_X.shape[0], f["H"], f["Hkv"], f["D"]
        if f["q_norm"] is not None:  # Qwen3: RMSNorm per head before rotary
            q_B_X = _rms(qkv_B_X[:, :H * D].view(B, H, D), f["q_norm"]).view(B, H * D)
            k_B_X = _rms(qkv_B_X[:, H * D:(H + K) * D].view(B, K, D), f["k_norm"]).view(B, K * D)
            qkv_B_X = torch.cat([q_B_X, k_B_X, qkv_B_X[:, (H + K) * D:]], dim=1)
        keys, values = s.keys[i], s.values[i]
        if s.kernels:  # token t-1 goes to slot Sp-1+t; slots start_b .. Sp+t-1 are visible
            return dk.rope_attention(qkv_B_X, s.cos_L_D, s.sin_L_D, s.pos_B, keys, values, s.start_B, s.t_1,
                                     f["scale"], s.attn_plan, H, K, end_offset=s.Sp)
        return dk.rope_attention_ref(qkv_B_X, s.cos_L_D, s.sin_L_D, s.pos_B, keys, values, s.start_B,
                                     s.Sp + int(s.t_1), f["scale"], H, K)

    def _mlp_act(self, f: dict, gu_B_X):
        """``act_fn(gate) * up`` of the fused gate/up projection (B, 2I) -> (B, I)."""
        gate_B_I, up_B_I = gu_B_X.chunk(2, dim=-1)
        return f["mlp"].act_fn(gate_B_I) * up_B_I

    @staticmethod
    def _linear(s: _Session, x_B_K, w_N_K, b_N):
        """``x @ w^T + b``: the GEMV kernel(s) at the session's small batch, else cuBLAS."""
        return dk.linear(x_B_K, w_N_K, b_N, pdl=s.pdl) if s.gemv else torch.nn.functional.linear(x_B_K, w_N_K, b_N)

    def _linear_add_norm(self, s: _Session, x_B_K, linear, h_B_H, norm):
        """The residual add ``h += linear(x)`` (in place) and HF's RMSNorm of the sum: (h, normed); at the
        session's small batch the projection's partial sums, the add and the norm in one kernel."""
        if s.gemv:
            return dk.linear_add_rms_norm(x_B_K, linear.weight, linear.bias, h_B_H, norm.weight, norm.variance_epsilon,
                                          pdl=s.pdl)
        return self._add_norm(s, h_B_H, self._linear(s, x_B_K, linear.weight, linear.bias), norm)

    def _layer(self, s: _Session, i: int, f: dict, h_B_H, x_B_H, next_norm):
        """Layer ``i`` for one token per row: ``h`` the residual stream, ``x`` its input norm; returns the new
        stream and its norm by ``next_norm`` (the next layer's input norm, or the final one)."""
        B = h_B_H.shape[0]
        o_B_H_D = self._attend(s, i, f, self._linear(s, x_B_H, f["w_qkv"], f["b_qkv"]))
        h_B_H, x_B_H = self._linear_add_norm(s, o_B_H_D.reshape(B, -1), f["attn"].o_proj, h_B_H, f["ln2"])
        if s.gemv and self.silu:  # the gate/up projection and silu * up in one pass
            act_B_I = dk.linear_silu(x_B_H, f["w_gu"], f["b_gu"], pdl=s.pdl)
        else:
            gu_B_X = self._linear(s, x_B_H, f["w_gu"], f["b_gu"])
            act_B_I = dk.silu_mul(gu_B_X, s.pdl) if s.kernels and self.silu else self._mlp_act(f, gu_B_X)
        return self._linear_add_norm(s, act_B_I, f["mlp"].down_proj, h_B_H, next_norm)

    def _sample(self, s: _Session, raw_B_V, t):
        """The sampled ids (B,) and their log π (B,) from raw logits (B, V) fp32 at token index ``t``."""
        if s.kernels and s.gumbel_plan is not None and not s.gumbel_plan.nucleus:  # top-p 1: one Gumbel-argmax kernel
            new_B = dk.gumbel_argmax(raw_B_V, s.seeds_B, t, s.gumbel_plan)
            z_B_V = raw_B_V if s.temperature == 1.0 else raw_B_V / s.temperature
            logp_B_V = mask_vocab(z_B_V, self.n_vocab).log_softmax(dim=-1)  # = policy_scores' at top-p 1
        else:
            scores_B_V, logp_B_V = policy_scores(raw_B_V, s.seeds_B, t, s.temperature, s.top_p, self.n_vocab)
            new_B = scores_B_V.argmax(-1)
        return new_B, logp_B_V.gather(1, new_B[:, None])[:, 0]

    def _step(self, s: _Session) -> None:
        """Feed token t-1 (slot Sp-1+t, position pos_b), sample token t; advance t and the positions."""
        m = self.gen.model
        h_B_H = m.embed_tokens(s.tok_B)
        x_B_H = self._norm(s, h_B_H, self.layers[0]["ln1"])
        norms = [f["ln1"] for f in self.layers[1:]] + [m.norm]  # each layer's output norm: the next one's input norm
        for i, (f, next_norm) in enumerate(zip(self.layers, norms)):
            h_B_H, x_B_H = self._layer(s, i, f, h_B_H, x_B_H, next_norm)
        raw_B_V = self.gen.lm_head(x_B_H)
        if s.kernels and s.gumbel_plan is not None:  # the sample (top-p < 1: the nucleus search first), its log π and
            # the step's writes
            dk.sample_token(raw_B_V, s.seeds_B, s.t_1, s.gumbel_plan, s.out_ids_B_T, s.out_logp_B_T, s.tok_B,
                            s.pos_B, s.done_B, s.eos_E)
        else:
            new_B, logp_B = self._sample(s, raw_B_V.float(), s.t_1)
            s.out_ids_B_T.index_copy_(1, s.t_1, new_B[:, None])
            s.out_logp_B_T.index_copy_(1, s.t_1, logp_B[:, None])
            s.done_B.logical_or_(torch.isin(new_B, s.eos_E))
            s.tok_B.copy_(new_B)
            s.pos_B.add_(1)
        s.t_1.add_(1)

    # --- prefill ----------------------------------------------------------------------------------

    def _prefill(self, s: _Session, ids_B_W, mask_B_W) -> torch.Tensor:
        """The prompts (left-padded, width W) into cache slots Sp-W..Sp-1; the raw logits (B, V) fp32 of
        the last position. The modules' own math (HF RMSNorm, rotary, grouped-query sdpa)."""
        B, W = ids_B_W.shape
        off = s.Sp - W
        m = self.gen.model
        pos_B_W = (mask_B_W.long().cumsum(1) - 1).clamp_min(0)
        cos_B_W_D, sin_B_W_D = s.cos_L_D[pos_B_W], s.sin_L_D[pos_B_W]
        causal_W_W = torch.ones((W, W), dtype=torch.bool, device=self.device).tril()
        eye_W_W = torch.eye(W, dtype=torch.bool, device=self.device)
        mask_B_1_W_W = (mask_B_W.bool()[:, None, None, :] & causal_W_W) | eye_W_W  # pads hidden; a row sees itself
        h_B_W_H = m.embed_tokens(ids_B_W)
        for i, f in enumerate(self.layers):
            H, K, D = f["H"], f["Hkv"], f["D"]
            qkv_B_W_X = torch.nn.functional.linear(f["ln1"](h_B_W_H), f["w_qkv"], f["b_qkv"])
            q_B_W_H_D = qkv_B_W_X[..., :H * D].view(B, W, H, D)
            k_B_W_K_D = qkv_B_W_X[..., H * D:(H + K) * D].view(B, W, K, D)
            v_B_K_W_D = qkv_B_W_X[..., (H + K) * D:].view(B, W, K, D).transpose(1, 2)
            if f["q_norm"] is not None:
                q_B_W_H_D, k_B_W_K_D = f["q_norm"](q_B_W_H_D), f["k_norm"](k_B_W_K_D)
            q_B_H_W_D = _rotate_half_apply(q_B_W_H_D.transpose(1, 2), cos_B_W_D, sin_B_W_D)
            k_B_K_W_D = _rotate_half_apply(k_B_W_K_D.transpose(1, 2), cos_B_W_D, sin_B_W_D)
            s.keys[i][:, :, off:s.Sp] = k_B_K_W_D
            s.values[i][:, :, off:s.Sp] = v_B_K_W_D
            G = H // K
            o_B_H_W_D = torch.nn.functional.scaled_dot_product_attention(
                q_B_H_W_D, k_B_K_W_D.repeat_interleave(G, dim=1), v_B_K_W_D.repeat_interleave(G, dim=1),
                attn_mask=mask_B_1_W_W, scale=f["scale"])
            h_B_W_H = h_B_W_H + f["attn"].o_proj(o_B_H_W_D.transpose(1, 2).reshape(B, W, H * D))
            gate_B_W_I, up_B_W_I = torch.nn.functional.linear(f["ln2"](h_B_W_H), f["w_gu"], f["b_gu"]).chunk(2, dim=-1)
            h_B_W_H = h_B_W_H + f["mlp"].down_proj(f["mlp"].act_fn(gate_B_W_I) * up_B_W_I)
        return self.gen.lm_head(m.norm(h_B_W_H[:, -1])).float()

    # --- the loop -----------------------------------------------------------------------------------

    def _session(self, B: int, W: int, T: int, temperature: float, top_p: float, eos_ids: list[int]) -> _Session:
        s = self.session
        if s is None or not s.fits(B, W, T, temperature, top_p, eos_ids):
            self.session = s = None  # free the old buffers (and graph) first
            Sp = -(-W // self.prompt_slots) * self.prompt_slots
            s = self.session = _Session(self, B, Sp, T, temperature, top_p, eos_ids)
        return s

    def _replay(self, s: _Session) -> None:
        """S = ``steps_per_graph`` decode steps by replaying the session's CUDA graph; its first call runs
        S steps eagerly on a side stream (which warms up the kernels and cuBLAS), then captures the graph
        (recorded, not run)."""
        S = self.steps_per_graph
        if s.graph is not None:
            s.graph.replay()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(S):
                self._step(s)
        torch.cuda.current_stream().wait_stream(side)
        t0 = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        # thread_local: another thread (the trainer, under rollout.overlap) may use CUDA meanwhile
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for _ in range(S):
                self._step(s)
        s.graph = g
        self.stats["capture_s"] = time.perf_counter() - t0
        self.stats["captures"] = self.stats.get("captures", 0) + 1

    @torch.no_grad()
    def generate(self, ids_B_Sp, mask_B_Sp, seeds: list[int], *, temperature: float, top_p: float,
                 max_new_tokens: int, eos_ids: list[int], check_every: int = 64,
                 should_stop=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled tokens (B, T) and their log-probs under the sampling policy (B, T); T <= max_new_tokens (stops
        once every row has emitted an EOS, checked every ``check_every`` tokens). ``should_stop()`` (default
        ``interrupt.check_abandon``: a stop signal or the step's wall-budget deadline) is called between graph
        replays (every ``steps_per_graph`` tokens); it raises to abandon the rollout."""
        should_stop = should_stop or interrupt.check_abandon
        if self.modules is not None:
            return self.modules.generate(ids_B_Sp, mask_B_Sp, seeds, temperature=temperature, top_p=top_p,
                                         max_new_tokens=max_new_tokens, eos_ids=eos_ids, check_every=check_every,
                                         should_stop=should_stop)
        with torch.autocast(self.device.type, enabled=False):
            B, W = ids_B_Sp.shape
            T = max_new_tokens
            s = self._session(B, W, T, float(temperature), float(top_p), list(eos_ids))
            n_prompt_B = mask_B_Sp.long().sum(1)
            left_B_W = (torch.arange(W, device=mask_B_Sp.device) >= W - n_prompt_B[:, None]).long()
            if not torch.equal(mask_B_Sp.long(), left_B_W):
                raise ValueError("the static decoder needs left-padded prompts (real tokens last in each row)")
            s.seeds_B.copy_(torch.tensor(seeds, dtype=torch.int64))
            s.start_B.copy_(s.Sp - n_prompt_B)
            s.done_B.zero_()
            s.t_1.zero_()
            raw_B_V = self._prefill(s, ids_B_Sp, mask_B_Sp)
            new_B, logp_B = self._sample(s, raw_B_V, s.t_1)
            s.out_ids_B_T[:, 0], s.out_logp_B_T[:, 0] = new_B, logp_B
            s.done_B.copy_(torch.isin(new_B, s.eos_E))
            s.tok_B.copy_(new_B)
            s.pos_B.copy_(n_prompt_B)  # position of token 0 = number of real prompt tokens
            s.t_1.fill_(1)
            t, S, next_check = 1, self.steps_per_graph, check_every
            while t < T:
                if self.use_graphs and (s.graph is not None or T - t >= S):
                    self._replay(s)  # S steps (a last replay past T fills the spare columns)
                    t += S
                else:
                    for _ in range(min(S, T - t)):
                        self._step(s)
                    t = min(T, t + S)
                if should_stop is not None:
                    should_stop()
                if t >= next_check:
                    next_check = t + check_every
                    if bool(s.done_B.all()):
                        break
            t = min(t, T)
            self.stats.update(decode_steps=t, fused_layers=True, kernels=s.kernels, steps_per_graph=S,
                              prompt_slots=s.Sp, pdl=s.pdl)
            return s.out_ids_B_T[:, :t].clone(), s.out_logp_B_T[:, :t].clone()


class _ModuleDecoder:
    """The modules' own forward with an HF ``StaticCache`` (architectures without ``_fused_layers``):
    one decode step captured as a CUDA graph per bucket of cache length (attention reads only the
    first ``bucket`` slots, so early tokens do not pay for the whole cache)."""

    def __init__(self, dec: StaticDecoder):
        self.dec = dec
        params = inspect.signature(dec.gen.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x

    def _forward(self, tok_B, pos_B, mask_B_1_1_n, cache):
        h_B_1_H = self.dec.gen.model(input_ids=tok_B[:, None], attention_mask=mask_B_1_1_n, position_ids=pos_B[:, None],
                                     use_cache=True, **{self.cache_kw: cache}).last_hidden_state
        return self.dec.gen.lm_head(h_B_1_H[:, -1]).float()

    def generate(self, ids_B_Sp, mask_B_Sp, seeds, *, temperature, top_p, max_new_tokens, eos_ids, check_every,
                 should_stop):
        from transformers import StaticCache

        dec = self.dec
        with torch.autocast(dec.device.type, enabled=False):
            B, Sp = ids_B_Sp.shape
            T = max_new_tokens
            L = Sp + T
            dev = dec.device
            cache = StaticCache(config=dec.gen.config, max_cache_len=L)
            seeds_B = torch.tensor(seeds, dtype=torch.int64, device=dev)
            eos_E = torch.tensor(eos_ids, dtype=torch.int64, device=dev)
            out_ids_B_T = torch.zeros((B, T), dtype=torch.int64, device=dev)
            out_logp_B_T = torch.zeros((B, T), dtype=torch.float32, device=dev)
            visible_B_L = torch.zeros((B, L), dtype=torch.bool, device=dev)  # cache slots holding real tokens
            visible_B_L[:, :Sp] = mask_B_Sp.bool()
            causal_Sp_Sp = torch.ones((Sp, Sp), dtype=torch.bool, device=dev).tril()
            mask_B_1_Sp_Sp = ((visible_B_L[:, None, None, :Sp] & causal_Sp_Sp)
                              | torch.eye(Sp, dtype=torch.bool, device=dev))
            pos_B_Sp = (mask_B_Sp.long().cumsum(1) - 1).clamp_min(0)
            h_B_Sp_H = dec.gen.model(input_ids=ids_B_Sp, attention_mask=mask_B_1_Sp_Sp, position_ids=pos_B_Sp,
                                     use_cache=True, **{self.cache_kw: cache}).last_hidden_state
            t_dev = torch.zeros((), dtype=torch.int64, device=dev)  # index of the token being sampled
            scores_B_V, logp_B_V = policy_scores(dec.gen.lm_head(h_B_Sp_H[:, -1]).float(), seeds_B, t_dev, temperature,
                                                 top_p, dec.n_vocab)
            tok_B = scores_B_V.argmax(-1)
            out_ids_B_T[:, 0] = tok_B
            out_logp_B_T[:, 0] = logp_B_V.gather(1, tok_B[:, None])[:, 0]
            done_B = torch.isin(tok_B, eos_E)
            pos_B = mask_B_Sp.long().sum(1)
            t_dev += 1

            def step(n: int):
                """Feed token t-1 (slot Sp-1+t), sample token t, attending to slots < n; device tensors only."""
                visible_B_L.index_fill_(1, (t_dev + (Sp - 1)).view(1), True)
                raw_B_V = self._forward(tok_B, pos_B, visible_B_L[:, None, None, :n], cache)
                scores_B_V, logp_B_V = policy_scores(raw_B_V, seeds_B, t_dev, temperature, top_p, dec.n_vocab)
                new_B = scores_B_V.argmax(-1)
                out_ids_B_T.index_copy_(1, t_dev.view(1), new_B[:, None])
                out_logp_B_T.index_copy_(1, t_dev.view(1), logp_B_V.gather(1, new_B[:, None]))
                done_B.logical_or_(torch.isin(new_B, eos_E))
                tok_B.copy_(new_B)
                pos_B.add_(1)
                t_dev.add_(1)

            graphs: dict[int, torch.cuda.CUDAGraph] = {}
            pool, t, prev_n = None, 1, 0
            while t < T:
                n = min(L, -(-(Sp + t) // dec.bucket) * dec.bucket)  # slots 0..Sp-1+t must be visible
                if not dec.use_graphs:
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
                        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                            step(n)
                        pool = g.pool()
                        graphs[n] = g
                    graphs[n].replay()
                prev_n = n
                t += 1
                should_stop()  # a stop signal or the wall budget ends the rollout here (StepAbandoned)
                if t % check_every == 0 and bool(done_B.all()):
                    break
            dec.stats = {"decode_steps": t, "graphs": len(graphs), "bucket": dec.bucket, "fused_layers": False}
            del graphs
            return out_ids_B_T[:, :t], out_logp_B_T[:, :t]

"""``HFEngine``: rollouts of the live policy with ``transformers`` models.

On CPU (or ``static_cache=False``) ``decode`` samples from the live model: ``model.generate``'s
greedy loop over the seeded sampler's scores (``sampling.SeededSampler``, the only processor),
written out with the model inputs ``generate`` passes (the attention mask, positions from it, a
dynamic KV cache), so its tokens and log-probs are ``generate``'s bit for bit (tests/test_rollout.py
compares them) at a quarter fewer Python calls per token and no copy of the whole KV cache per token
(``BufferLayer``). Nothing of the model's own ``generation_config`` (a checkpoint's
``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ``bad_words_ids`` ...) is read.
On CUDA with ``static_cache=True`` the static-KV-cache, CUDA-graph decoder (``engines.static``)
samples from a bf16 inference copy, refreshed by ``sync_weights`` (LoRA merged in).

Both sample ids below ``len(tokenizer)`` only (a model with padding embedding rows never emits
one) and record log π of each sampled token: the policy it was drawn from, tempered and
top-p-truncated over those ids (``engines.sampling``'s convention; recorded whatever
``sample``'s ``logprobs`` says: they cost nothing here).

Both decode loops call ``interrupt.check_abandon()`` between tokens: a rollout armed by the training
loop ends there (``StepAbandoned``) once a stop signal arrives or its wall-budget deadline passes.

``own_copy=True`` (the one-step-off rollout, ``opdkit.overlap``): ``generate`` runs on a frozen
copy of the policy that ``sync_weights`` refreshes, not on the live model, so the trainer may
update the live weights while a rollout is drawn (the static decoder holds a copy anyway).
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from opdkit import interrupt
from opdkit.engines.base import Rollout, completion_mask, concat, left_pad, pad_and_eos, sampling_vocab
from opdkit.engines.sampling import SeededSampler
from opdkit.engines.static import StaticDecoder
from opdkit.engines.weights import plain


class BufferLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in one buffer, allocated at the first update
    with room for ``extra`` more positions: an update writes into it and returns views of the filled
    part, the values ``DynamicLayer`` returns (there: a ``torch.cat`` of the whole cache per token)."""

    def __init__(self, extra: int):
        super().__init__()
        self.extra = extra

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, S, D = key_states.shape  # (batch, K/V heads, positions, head dim)
        self.buf_k_B_H_L_D = key_states.new_empty((B, H, S + self.extra, D))
        self.buf_v_B_H_L_D = value_states.new_empty((B, H, S + self.extra, value_states.shape[-1]))
        self.filled, self.device, self.is_initialized = 0, key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.filled + key_states.shape[-2]
        if n > self.buf_k_B_H_L_D.shape[-2]:
            raise ValueError(f"BufferLayer: {n} positions, room for {self.buf_k_B_H_L_D.shape[-2]}")
        self.buf_k_B_H_L_D[:, :, self.filled:n] = key_states
        self.buf_v_B_H_L_D[:, :, self.filled:n] = value_states
        self.filled = n
        self.keys, self.values = self.buf_k_B_H_L_D[:, :, :n], self.buf_v_B_H_L_D[:, :, :n]
        return self.keys, self.values


def decode_cache(model, extra: int) -> DynamicCache:
    """The dynamic cache ``generate`` makes for ``model``, its full-attention layers as ``BufferLayer``s
    with room for ``extra`` positions past the prompt (other layer kinds, e.g. sliding windows, as they are)."""
    cache = DynamicCache(config=plain(model).config.get_text_config(decoder=True))
    cache.layers = [BufferLayer(extra) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@torch.no_grad()
def decode(model, ids_B_Sp, mask_B_Sp, sampler, *, max_new_tokens: int, eos_ids: list[int], pad_id: int):
    """Greedy decoding of ``sampler``'s scores (a ``SeededSampler``): (completions (B, T), the
    sampler's log-probs (B, T)), T <= ``max_new_tokens``. As ``model.generate`` (greedy, this one
    processor) runs it: the prefill and each token with the attention mask so far and positions
    from it (``cumsum - 1``, 0 on the left pads), the head on the last position (``logits_to_keep``),
    a finished row fed ``pad_id``, a stop when every row has emitted an EOS or at the token cap.
    ``model`` in eval mode."""
    B, Sp = ids_B_Sp.shape
    if max_new_tokens <= 0:
        comp_B_0 = ids_B_Sp.new_zeros((B, 0))
        return comp_B_0, sampler.finish(comp_B_0)
    params = inspect.signature(plain(model).forward).parameters
    cache = decode_cache(model, max_new_tokens)
    kw = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True, "return_dict": True}
    if "logits_to_keep" in params:  # as generate: the head on the last position only
        kw["logits_to_keep"] = 1
    eos_E = torch.tensor(eos_ids, device=ids_B_Sp.device)
    seq_B_S, mask_B_S = ids_B_Sp, mask_B_Sp
    live_B = torch.ones(B, dtype=torch.long, device=ids_B_Sp.device)
    out = model(input_ids=ids_B_Sp, attention_mask=mask_B_S, position_ids=(mask_B_S.cumsum(-1) - 1).clamp_min(0), **kw)
    for t in range(max_new_tokens):
        interrupt.check_abandon()  # a stop signal or the wall budget ends the rollout here (StepAbandoned)
        scores_B_V = sampler(seq_B_S, out.logits[:, -1].to(copy=True, dtype=torch.float32))
        next_B = scores_B_V.argmax(-1) * live_B + pad_id * (1 - live_B)
        seq_B_S = torch.cat([seq_B_S, next_B[:, None]], dim=1)
        live_B = live_B & ~torch.isin(next_B, eos_E)
        if t + 1 == max_new_tokens or not bool(live_B.any()):
            break
        mask_B_S = torch.cat([mask_B_S, mask_B_S.new_ones((B, 1))], dim=1)
        out = model(input_ids=next_B[:, None], attention_mask=mask_B_S, position_ids=mask_B_S.sum(-1, keepdim=True) - 1,
                    **kw)
    comp_B_T = seq_B_S[:, Sp:]
    return comp_B_T, sampler.finish(comp_B_T)


class HFEngine:
    """Rollouts of the live policy (see the module docstring)."""

    def __init__(self, model, tokenizer, *, static_cache: bool = True, batch_size: int = 0, own_copy: bool = False,
                 decoder: dict | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.static_cache = static_cache
        self.batch_size = batch_size  # rows per decode call; 0 = all at once
        self.pad_id, self.eos_ids = pad_and_eos(plain(model), tokenizer)
        self.n_vocab = sampling_vocab(plain(model), tokenizer)
        device = next(model.parameters()).device
        # the static decoder holds a copy (needs full weights only in sync_weights); decode reads the live
        # model, or a frozen copy of it (own_copy)
        self.uses_decoder = static_cache and device.type == "cuda"
        self.own_copy = own_copy and not self.uses_decoder
        self.reads_live_model = not (self.uses_decoder or self.own_copy)
        self.decoder_options = dict(decoder or {})  # StaticDecoder's keyword options (``select.decoder_options``)
        self.decoder = StaticDecoder(model, n_vocab=self.n_vocab, **self.decoder_options) if self.uses_decoder else None
        if self.own_copy:
            self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        """The next ``sample`` samples ``model``'s current weights (copied into the decoder or the copy, if any)."""
        if self.own_copy:
            live = dict(model.named_parameters())
            for name, p in self.model.named_parameters():
                p.copy_(live[name])
            return
        self.model = model
        if self.decoder is not None:
            self.decoder.sync(model)

    @torch.no_grad()
    def sample(self, prompts, *, samples_per_prompt, seeds, temperature, top_p, max_new_tokens,
               logprobs: bool = True) -> Rollout:
        rows = [p for p in prompts for _ in range(samples_per_prompt)]  # prompt-major: B = P*G
        if len(seeds) != len(rows):
            raise ValueError(f"need one seed per sample: {len(rows)} samples, {len(seeds)} seeds")
        device = next(self.model.parameters()).device
        step = self.batch_size or len(rows)
        parts = [self._generate(rows[i:i + step], seeds[i:i + step], temperature, top_p, max_new_tokens, device)
                 for i in range(0, len(rows), step)]
        prompt_index_B = torch.arange(len(prompts)).repeat_interleave(samples_per_prompt)
        return concat(parts, prompt_index_B, self.pad_id)

    def _generate(self, rows, seeds, temperature, top_p, max_new_tokens, device):
        ids_B_Sp, mask_B_Sp = left_pad(rows, self.pad_id, device)
        if self.decoder is not None:
            comp_B_T, logp_B_T = self.decoder.generate(ids_B_Sp, mask_B_Sp, seeds, temperature=temperature, top_p=top_p,
                                                       max_new_tokens=max_new_tokens, eos_ids=self.eos_ids)
        else:
            comp_B_T, logp_B_T = self._hf_generate(ids_B_Sp, mask_B_Sp, seeds, temperature, top_p, max_new_tokens)
        mask_B_T, truncated_B = completion_mask(comp_B_T, self.eos_ids)
        comp_B_T = torch.where(mask_B_T.bool(), comp_B_T, torch.full_like(comp_B_T, self.pad_id))
        return ids_B_Sp, mask_B_Sp, comp_B_T, mask_B_T, logp_B_T * mask_B_T, truncated_B

    def _hf_generate(self, ids_B_Sp, mask_B_Sp, seeds, temperature, top_p, max_new_tokens):
        sampler = SeededSampler(seeds, temperature, top_p, ids_B_Sp.shape[1], ids_B_Sp.device, self.n_vocab)
        was_training = self.model.training
        self.model.eval()
        try:
            return decode(self.model, ids_B_Sp, mask_B_Sp, sampler, max_new_tokens=max_new_tokens, eos_ids=self.eos_ids,
                          pad_id=self.pad_id)
        finally:
            self.model.train(was_training)

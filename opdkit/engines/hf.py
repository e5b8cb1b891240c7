"""``HFEngine``: rollouts of the live policy with ``transformers`` models.

On CPU (or ``static_cache=False``) ``model.generate`` runs on the live model with the seeded
sampler (``sampling.SeededSampler``) as its only logits processor, under a generation config
that holds exactly the engine's settings: the model's own ``generation_config`` (a checkpoint's
``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ``bad_words_ids`` ...)
is set aside for the call, because ``generate`` fills every unset field from it. On CUDA with
``static_cache=True`` the static-KV-cache, CUDA-graph decoder (``engines.static``) samples from a
bf16 inference copy, refreshed by ``sync_weights`` (LoRA merged in).

Both sample ids below ``len(tokenizer)`` only (a model with padding embedding rows never emits
one) and record log π of each sampled token: the policy it was drawn from, tempered and
top-p-truncated over those ids (``engines.sampling``'s convention; recorded whatever
``sample``'s ``logprobs`` says: they cost nothing here).

``own_copy=True`` (the one-step-off rollout, ``opdkit.overlap``): ``generate`` runs on a frozen
copy of the policy that ``sync_weights`` refreshes, not on the live model, so the trainer may
update the live weights while a rollout is drawn (the static decoder holds a copy anyway).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import GenerationConfig, LogitsProcessorList

from opdkit.engines.base import Rollout, completion_mask, concat, left_pad, pad_and_eos, sampling_vocab
from opdkit.engines.sampling import SeededSampler
from opdkit.engines.static import StaticDecoder
from opdkit.engines.weights import plain


@contextlib.contextmanager
def own_generation_config(model, gen_cfg: GenerationConfig):
    """``model.generation_config`` is ``gen_cfg`` inside the block (and the model's own after):
    ``generate`` fills every field the passed config leaves unset from ``model.generation_config``,
    so with the two the same nothing of the checkpoint's generation settings gets in."""
    base = plain(model)
    saved = base.generation_config
    base.generation_config = gen_cfg
    try:
        yield
    finally:
        base.generation_config = saved


def sampling_config(*, max_new_tokens: int, eos_ids: list[int], pad_id: int, bos_id) -> GenerationConfig:
    """Greedy decoding of the sampler's perturbed logits and nothing else: every processor that
    ``generate`` could add (penalties, n-gram blocking, length floors, bad words, top-k, ...) off."""
    return GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=None, min_length=0,
        eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=bos_id, disable_compile=True,
        temperature=1.0, top_k=None, top_p=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0, bad_words_ids=None, suppress_tokens=None, begin_suppress_tokens=None,
        forced_bos_token_id=None, forced_eos_token_id=None, sequence_bias=None, renormalize_logits=False,
        exponential_decay_length_penalty=None, use_cache=True, return_dict_in_generate=False, output_scores=False,
    )


class HFEngine:
    """Rollouts of the live policy (see the module docstring)."""

    def __init__(self, model, tokenizer, *, static_cache: bool = True, batch_size: int = 0, own_copy: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.static_cache = static_cache
        self.batch_size = batch_size  # rows per generate call; 0 = all at once
        self.pad_id, self.eos_ids = pad_and_eos(plain(model), tokenizer)
        self.n_vocab = sampling_vocab(plain(model), tokenizer)
        device = next(model.parameters()).device
        # the static decoder holds a copy (needs full weights only in sync_weights); generate reads the live
        # model, or a frozen copy of it (own_copy)
        self.uses_decoder = static_cache and device.type == "cuda"
        self.own_copy = own_copy and not self.uses_decoder
        self.reads_live_model = not (self.uses_decoder or self.own_copy)
        self.decoder = StaticDecoder(model, n_vocab=self.n_vocab) if self.uses_decoder else None
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
        gen_cfg = sampling_config(max_new_tokens=max_new_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id,
                                  bos_id=self.tokenizer.bos_token_id)
        was_training = self.model.training
        self.model.eval()
        try:
            with own_generation_config(self.model, gen_cfg):
                out_B_S = self.model.generate(
                    input_ids=ids_B_Sp, attention_mask=mask_B_Sp, generation_config=gen_cfg,
                    logits_processor=LogitsProcessorList([sampler]),
                )
        finally:
            self.model.train(was_training)
        comp_B_T = out_B_S[:, ids_B_Sp.shape[1]:]
        return comp_B_T, sampler.finish(comp_B_T)

"""The reference the HF engine's decode loop is checked against: ``transformers``' own ``generate``,
greedy over the seeded sampler's scores (its only logits processor), with every other processor off
and none of the model's own generation settings (the engine's sampling path before issue 27)."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList

from opdkit.engines.base import left_pad, pad_and_eos, sampling_vocab
from opdkit.engines.sampling import SeededSampler


@torch.no_grad()
def generate_reference(model, tok, rows: list[list[int]], seeds: list[int], temperature: float, top_p: float,
                       max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt ids, prompt mask, completions (B, T), the sampler's log-probs (B, T)) of ``model.generate``."""
    pad, eos = pad_and_eos(model, tok)
    ids_B_Sp, mask_B_Sp = left_pad(rows, pad)
    sampler = SeededSampler(seeds, temperature, top_p, ids_B_Sp.shape[1], ids_B_Sp.device, sampling_vocab(model, tok))
    cfg = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=None, min_length=0,
        eos_token_id=eos, pad_token_id=pad, bos_token_id=tok.bos_token_id, disable_compile=True, temperature=1.0,
        top_k=None, top_p=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0,
        bad_words_ids=None, suppress_tokens=None, begin_suppress_tokens=None, forced_bos_token_id=None,
        forced_eos_token_id=None, sequence_bias=None, renormalize_logits=False, exponential_decay_length_penalty=None,
        use_cache=True, return_dict_in_generate=False, output_scores=False)
    saved, model.generation_config = model.generation_config, cfg  # generate fills unset fields from the model's own
    was_training = model.training
    model.eval()
    try:
        out_B_S = model.generate(input_ids=ids_B_Sp, attention_mask=mask_B_Sp, generation_config=cfg,
                                 logits_processor=LogitsProcessorList([sampler]))
    finally:
        model.generation_config = saved
        model.train(was_training)
    comp_B_T = out_B_S[:, ids_B_Sp.shape[1]:]
    return ids_B_Sp, mask_B_Sp, comp_B_T, sampler.finish(comp_B_T)

"""Sampling is exactly what the params say: a checkpoint's generation_config.json does not get into
the HF engine's ``generate``, and a model with padding embedding rows never samples one (the same
tokens as the model with those rows removed)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from opdkit.engines.base import left_pad
from opdkit.engines.hf import HFEngine
from opdkit.engines.sampling import sample_seed
from opdkit.engines.static import StaticDecoder
from opdkit.models import load_model
from opdkit.scoring import build_geometry, completion_hidden, token_logprobs, unwrap

PROMPTS = ["Compute 47+5-29.", "Compute 3+4.", "Compute 88-80+17-5."]


def _recomputed(model, ro) -> torch.Tensor:
    g = build_geometry(ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp, ro.completion_ids_B_T, ro.completion_mask_B_T)
    with torch.no_grad():
        return token_logprobs(unwrap(model)[1], completion_hidden(model, g), ro.completion_ids_B_T, 4096)


def test_a_checkpoints_generation_config_does_not_change_what_is_sampled(tiny_llama, tok, tmp_path):
    """The model dir ships repetition_penalty 1.3, no_repeat_ngram_size 2, min_new_tokens 12 and
    bad_words_ids: the tokens equal those of the same weights without that file, and the
    sampling-time log-probs equal the recomputed raw ones (fp32)."""
    tiny_llama.save_pretrained(tmp_path)
    eos = tok.eos_token_id
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "eos_token_id": eos, "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id,
        "repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 12, "bad_words_ids": [[5], [7]],
        "do_sample": True, "top_k": 3, "temperature": 0.3}))
    shipped = load_model(tmp_path, torch.device("cpu"))
    assert shipped.generation_config.repetition_penalty == 1.3  # the file was read
    prompts = [tok(p).input_ids for p in PROMPTS]
    kw = dict(samples_per_prompt=2, seeds=[sample_seed(0, 0, i) for i in range(6)], temperature=1.0, top_p=1.0,
              max_new_tokens=24)
    ro = HFEngine(shipped, tok, static_cache=False).sample(prompts, **kw)
    ref = HFEngine(copy.deepcopy(tiny_llama), tok, static_cache=False).sample(prompts, **kw)
    assert torch.equal(ro.completion_ids_B_T, ref.completion_ids_B_T)
    m = ro.completion_mask_B_T.bool()
    assert (_recomputed(shipped, ro) - ro.sampling_logp_B_T).abs()[m].max() < 1e-6  # measured 2.4e-7
    assert shipped.generation_config.repetition_penalty == 1.3  # the model's own config is back after the call
    # and the file's settings would have changed the sample: plain generate with them differs
    ids, mask = left_pad(prompts, tok.pad_token_id)
    with torch.no_grad():
        inherited = shipped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        plain_greedy = copy.deepcopy(tiny_llama).generate(input_ids=ids, attention_mask=mask, max_new_tokens=24,
                                                          do_sample=False, eos_token_id=eos,
                                                          pad_token_id=tok.pad_token_id)
    assert not torch.equal(inherited, plain_greedy)


def _with_padding_rows(model, extra: int):
    """``model`` with ``extra`` output rows past its vocabulary, made to dominate the logits."""
    big = copy.deepcopy(model)
    V = big.lm_head.weight.shape[0]
    big.resize_token_embeddings(V + extra, mean_resizing=False)
    with torch.no_grad():
        big.lm_head.weight[V:] = big.lm_head.weight[:extra] * 5.0  # large logits: without the mask they would be drawn
    return big


@pytest.mark.parametrize("engine", ["generate", "static"])
def test_padding_rows_are_never_sampled(tiny_llama, tok, engine):
    """Same tokens and log-probs as the model without its padding rows (the noise of id v does not
    depend on V), and no id >= len(tokenizer)."""
    padded = _with_padding_rows(tiny_llama, 16)
    prompts = [tok(p).input_ids for p in PROMPTS]
    seeds = [sample_seed(1, 0, i) for i in range(3)]
    kw = dict(samples_per_prompt=1, seeds=seeds, temperature=1.0, top_p=0.95, max_new_tokens=16)
    ref = HFEngine(tiny_llama, tok, static_cache=False).sample(prompts, **kw)
    if engine == "generate":
        ro = HFEngine(padded, tok, static_cache=False).sample(prompts, **kw)
        comp, logp = ro.completion_ids_B_T, ro.sampling_logp_B_T
        m = ro.completion_mask_B_T.bool()
    else:
        ids, mask = left_pad(prompts, tok.pad_token_id)
        dec = StaticDecoder(padded, dtype=torch.float32, use_graphs=False, n_vocab=len(tok))
        comp, logp = dec.generate(ids, mask, seeds, temperature=1.0, top_p=0.95, max_new_tokens=16,
                                  eos_ids=[tok.eos_token_id])
        m = ref.completion_mask_B_T.bool()
        comp = torch.where(m, comp[:, :m.shape[1]], torch.full_like(m, tok.pad_token_id, dtype=torch.long))
        logp = logp[:, :m.shape[1]] * m
    assert int(comp.max()) < len(tok)
    assert torch.equal(comp, ref.completion_ids_B_T)
    assert (logp - ref.sampling_logp_B_T).abs()[m].max() < 1e-5
    # the unmasked head would have drawn padding ids: its raw argmax often lands there
    with torch.no_grad():
        h = padded.model(input_ids=torch.tensor([prompts[0]])).last_hidden_state
        assert int(padded.lm_head(h)[0].argmax(-1).max()) >= len(tok)


def test_every_decode_setting_of_the_params_reaches_the_static_decoder(tiny_llama, tok):
    """``rollout.decode_*`` (gemv, pdl) go to the HF engine as the static decoder's keyword options, each with the
    value the params give, and the decoder takes each of them (the decoder itself is built only on CUDA)."""
    import inspect

    from opdkit.config import load_config
    from opdkit.engines.select import make_engine

    keys = ("gemv", "pdl")
    for value in (True, False):
        cfg = load_config(None, ["rollout.engine=hf"] + [f"rollout.decode_{k}={str(value).lower()}" for k in keys])
        engine = make_engine(cfg, tiny_llama, tok)
        assert engine.decoder_options == {k: value for k in keys}
        inspect.signature(StaticDecoder).bind(tiny_llama, **engine.decoder_options)

"""The static-cache decoder (opdkit.engines.static) against HF generate, eagerly on the CPU (the GPU
tests in test_gpu.py check CUDA-graph replay against this eager path)."""

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from opdkit.engines.base import left_pad
from opdkit.engines.decode_kernels import gemv_config, rotate
from opdkit.engines.hf import HFEngine
from opdkit.engines.sampling import policy_scores, sample_seed, uniform_noise
from opdkit.engines.static import StaticDecoder, inference_copy

PROMPTS = ["Compute 47+5-29.", "Compute 3+4.", "Compute 88-80+17-5."]


def _kw(tok, **extra):
    return dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **extra)


def _compare(model, tok, top_p=1.0, G=2, T=20):
    ids = [tok(p).input_ids for p in PROMPTS]
    seeds = [sample_seed(7, 3, i) for i in range(len(ids) * G)]
    eng = HFEngine(model, tok)
    ro = eng.sample(ids, samples_per_prompt=G, seeds=seeds, temperature=1.0, top_p=top_p, max_new_tokens=T)
    p_ids, p_mask = left_pad([p for p in ids for _ in range(G)], eng.pad_id)
    dec = StaticDecoder(model, dtype=torch.float32, bucket=8)
    assert dec.layers is not None  # the fused per-token layer path
    out, logp = dec.generate(p_ids, p_mask, seeds, temperature=1.0, top_p=top_p, max_new_tokens=T, eos_ids=eng.eos_ids,
                             check_every=4)
    m = ro.completion_mask_B_T.bool()
    W = m.shape[1]
    assert out.shape[1] >= W
    assert torch.equal(out[:, :W][m], ro.completion_ids_B_T[m])
    assert (logp[:, :W][m] - ro.sampling_logp_B_T[m]).abs().max() < 1e-5


def test_static_decoder_matches_generate(tiny_llama, tok):
    """Left pads, positions from the mask, the static cache slots and the grouped-query
    attention give the tokens and log-probs of HF generate (Llama and Qwen2, top-p on and off)."""
    _compare(tiny_llama, tok)
    torch.manual_seed(1)
    _compare(Qwen2ForCausalLM(Qwen2Config(**_kw(tok))).eval(), tok, top_p=0.9)


def test_lora_is_merged_into_the_inference_copy(tok):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(Qwen3ForCausalLM(Qwen3Config(**_kw(tok, head_dim=8, tie_word_embeddings=True))),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                      task_type="CAUSAL_LM"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    model.eval()
    x = torch.tensor([tok(PROMPTS[0]).input_ids])
    causal = torch.ones(1, 1, x.shape[1], x.shape[1], dtype=torch.bool).tril()
    with torch.no_grad():
        gen = inference_copy(model, torch.float32)
        want, got = model(input_ids=x).logits, gen(input_ids=x, attention_mask=causal).logits
        with model.disable_adapter():
            base = model(input_ids=x).logits
    assert (want - base).abs().max() > 1e-2 and (got - want).abs().max() < 1e-5
    _compare(model, tok, G=1)


def test_noise_is_uniform_and_counter_based():
    seeds = torch.tensor([sample_seed(0, 0, i) for i in range(64)])
    u = uniform_noise(seeds, 3, 4096)
    assert u.min() > 0 and u.max() < 1 and abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert torch.equal(uniform_noise(seeds[5:6], 3, 100), u[5:6, :100])  # a row's noise ignores the batch and V
    assert not torch.equal(uniform_noise(seeds, 4, 4096), u)  # fresh noise per token index


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_policy_scores_greedy_and_tempered(temperature):
    raw = torch.randn(3, 50)
    seeds = torch.tensor([1, 2, 3])
    out, logp = policy_scores(raw, seeds, 0, temperature, 1.0)
    if temperature == 0:  # greedy: the argmax, and the model's own log-probs
        assert torch.equal(out.argmax(-1), raw.argmax(-1)) and torch.equal(logp, raw.log_softmax(-1))
    else:
        assert torch.equal(out, policy_scores(raw, seeds, 0, temperature, 1.0)[0])
        assert torch.allclose(logp, (raw / temperature).log_softmax(-1), atol=1e-6)


def test_fused_layers_follow_weight_updates(tok):
    """After an update of the live model, ``sync`` refreshes the fused q/k/v and gate/up buffers:
    the fused path and the modules' own forward agree again."""
    torch.manual_seed(2)
    model = Qwen2ForCausalLM(Qwen2Config(**_kw(tok))).eval()
    fused, plain = StaticDecoder(model, dtype=torch.float32), StaticDecoder(model, dtype=torch.float32, fused=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    fused.sync(model)
    plain.sync(model)
    p_ids, p_mask = left_pad([tok(p).input_ids for p in PROMPTS], tok.pad_token_id)
    kw = dict(temperature=1.0, top_p=1.0, max_new_tokens=24, eos_ids=[-1])
    a, la = fused.generate(p_ids, p_mask, [1, 2, 3], **kw)
    b, lb = plain.generate(p_ids, p_mask, [1, 2, 3], **kw)
    assert torch.equal(a, b) and (la - lb).abs().max() < 1e-5
    _compare(model, tok)


def test_the_decoders_rotation_is_hf_rotary_embedding():
    """``decode_kernels.rotate`` (the decode step's rotary embedding, rounded once) equals transformers'
    own apply_rotary_pos_emb (rotate_half) at each row's position, for queries and keys, in fp32 and
    within one bf16 rounding in bf16 (HF rounds the two products and their sum separately)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

    cfg = Qwen2Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192)
    rope = Qwen2RotaryEmbedding(cfg)
    torch.manual_seed(0)
    pos_B = torch.tensor([0, 5, 777, 7000])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)):
        q_B_H_D, k_B_K_D = torch.randn(4, 2, 128, dtype=dtype), torch.randn(4, 1, 128, dtype=dtype)
        cos_B_1_D, sin_B_1_D = rope(q_B_H_D, pos_B[:, None])
        # HF's layout: (B, heads, S, D) with cos / sin (B, S, D) unsqueezed over the heads
        want_q, want_k = apply_rotary_pos_emb(q_B_H_D[:, :, None], k_B_K_D[:, :, None], cos_B_1_D, sin_B_1_D)
        for x, want in ((q_B_H_D, want_q[:, :, 0]), (k_B_K_D, want_k[:, :, 0])):
            got = rotate(x, cos_B_1_D[:, 0], sin_B_1_D[:, 0])
            err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1.0)).max()
            assert err <= tol, (dtype, float(err))  # one bf16 ulp at |x| in [1, 2) is 2^-7


def test_the_gemv_rule_loads_first_no_more_blocks_than_a_split_has():
    """``gemv_config``'s PRE (the blocks of weights loaded before the kernel before has finished) fits in one split
    of the inputs at every shape, small models' included (a PRE past the split's blocks is refused at launch: the
    GPU tests of tiny models found the rule's PRE 2 there), and the rule's measured choices at the 1.5B shape hold."""
    for n_out in (8, 32, 64, 256, 1536, 2048, 4096, 8960, 151936):
        for n_in in (8, 32, 64, 256, 257, 512, 1536, 2048, 4096, 8960):
            block_n, block_k, split, warps, stages, pre = gemv_config(n_out, n_in)
            blocks = math.ceil(math.ceil(n_in / split) / block_k)  # of one split, as gemv_launch rounds it
            assert 1 <= pre <= blocks, (n_out, n_in, pre)
    assert gemv_config(1536, 1536)[5] == 2 and gemv_config(2048, 1536)[5] == 1 and gemv_config(1536, 8960)[5] == 1

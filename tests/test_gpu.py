"""The CUDA path: static-cache CUDA-graph decoding, bf16 autocast training pieces, chunked
log-probs, gradient checkpointing. Skipped without a GPU."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _small(vocab, arch="qwen2", layers=2, seed=0, dtype=torch.float32, **kw):
    from opdkit.models import random_model, shape_config

    cfg = shape_config("qwen3-1.7b" if arch == "qwen3" else "qwen2-1.5b", vocab_size=vocab, hidden_size=128,
                       intermediate_size=256, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                       **({"head_dim": 16} if arch == "qwen3" else {}), **kw)
    return random_model(cfg, "cuda", dtype, seed=seed)


def test_noise_is_the_same_on_cpu_and_gpu():
    from opdkit.engines.sampling import uniform_noise

    seeds = torch.tensor([0, 1, 2**62 + 12345, 7])
    for t in (0, 5, 4096):
        assert torch.equal(uniform_noise(seeds, t, 1000), uniform_noise(seeds.cuda(), t, 1000).cpu())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_graph_replay_equals_eager_decoding(tok, arch):
    from opdkit.engines.static import StaticDecoder
    from opdkit.engines.base import left_pad

    model = _small(len(tok), arch, dtype=torch.bfloat16)
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4.", "Compute 88-80+17-5."]]
    ids, mask = left_pad(prompts, tok.pad_token_id, "cuda")
    kw = dict(temperature=1.0, top_p=0.95, max_new_tokens=300, eos_ids=[-1])  # no EOS: 300 tokens, 5 buckets
    graph = StaticDecoder(model, bucket=64)
    a_ids, a_logp = graph.generate(ids, mask, [1, 2, 3], **kw)
    b_ids, b_logp = StaticDecoder(model, bucket=64, use_graphs=False).generate(ids, mask, [1, 2, 3], **kw)
    assert graph.stats["graphs"] >= 4
    assert torch.equal(a_ids, b_ids) and torch.equal(a_logp, b_logp)


def test_fused_graph_decoding_matches_the_modules_forward_in_fp32(tok):
    from opdkit.engines.static import StaticDecoder
    from opdkit.engines.base import left_pad

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _small(len(tok), "qwen3")
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4."]]
    ids, mask = left_pad(prompts, tok.pad_token_id, "cuda")
    kw = dict(temperature=1.0, top_p=1.0, max_new_tokens=200, eos_ids=[-1])
    fast = StaticDecoder(model, dtype=torch.float32, bucket=64)  # fused layers, CUDA graphs
    a_ids, a_logp = fast.generate(ids, mask, [1, 2], **kw)
    slow = StaticDecoder(model, dtype=torch.float32, use_graphs=False, fused=False)
    b_ids, b_logp = slow.generate(ids, mask, [1, 2], **kw)
    assert fast.stats["fused_layers"] and fast.stats["graphs"] >= 3
    assert torch.equal(a_ids, b_ids) and (a_logp - b_logp).abs().max() < 1e-4


def test_static_decoder_matches_generate_in_fp32(tok):
    """Same tokens as HF generate (dynamic cache) when both run in fp32: the cache geometry,
    positions, masks and grouped-query attention of the decoder are right."""
    from opdkit.engines.static import StaticDecoder
    from opdkit.engines.base import left_pad
    from opdkit.engines.hf import HFEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _small(len(tok), "qwen2").eval()
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4."]]
    ro = HFEngine(model, tok, static_cache=False).sample(prompts, samples_per_prompt=2, seeds=[5, 6, 7, 8],
                                                         temperature=1.0, top_p=1.0, max_new_tokens=40)
    ids, mask = left_pad([p for p in prompts for _ in range(2)], tok.pad_token_id, "cuda")
    out, logp = StaticDecoder(model, dtype=torch.float32, bucket=16).generate(
        ids, mask, [5, 6, 7, 8], temperature=1.0, top_p=1.0, max_new_tokens=40, eos_ids=[tok.eos_token_id])
    m = ro.completion_mask_B_T.bool()
    T = m.shape[1]
    assert torch.equal(out[:, :T][m], ro.completion_ids_B_T[m])
    assert (logp[:, :T][m] - ro.sampling_logp_B_T[m]).abs().max() < 1e-4


def test_lora_policy_is_merged_into_the_inference_copy(tok):
    from peft import LoraConfig, get_peft_model

    from opdkit.engines.static import inference_copy

    torch.backends.cuda.matmul.allow_tf32 = False
    model = get_peft_model(_small(len(tok), "qwen3", tie_word_embeddings=True),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], task_type="CAUSAL_LM"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3)
    gen = inference_copy(model, torch.float32)
    x = torch.tensor([tok("Compute 3+4.").input_ids], device="cuda")
    causal = torch.ones(1, 1, x.shape[1], x.shape[1], dtype=torch.bool, device="cuda").tril()
    with torch.no_grad():
        want = model(input_ids=x).logits
        got = gen(input_ids=x, attention_mask=causal).logits
        with model.disable_adapter():
            base = model(input_ids=x).logits
    assert (want - base).abs().max() > 1e-2  # the adapter matters ...
    assert (got - want).abs().max() < 1e-4  # ... and the copy has it


def _step_grads(tok, grad_ckpt: bool):
    from opdkit import opd
    from opdkit.config import config_from_dict
    from opdkit.engines.hf import HFEngine

    cfg = config_from_dict({"loss": {"name": "k1"}, "runtime": {"logprob_chunk": 16, "grad_checkpointing": grad_ckpt}})
    student = _small(len(tok), "qwen2", layers=3, seed=0)
    teacher = _small(len(tok), "qwen2", layers=3, seed=1, dtype=torch.bfloat16).eval().requires_grad_(False)
    if grad_ckpt:
        student.gradient_checkpointing_enable()
        student.config.use_cache = False
    student.train()
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4."]]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ro = HFEngine(student, tok).sample(prompts, samples_per_prompt=2, seeds=[1, 2, 3, 4], temperature=1.0,
                                           top_p=1.0, max_new_tokens=48)
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16)

    contexts = opd.score_batch(cfg, teacher, batch, autocast)
    m = opd.micro_losses(cfg, student, batch, contexts, autocast)
    return m, {n: p.grad.clone() for n, p in student.named_parameters()}, ro


def test_bf16_step_with_and_without_gradient_checkpointing(tok):
    m1, g1, ro = _step_grads(tok, grad_ckpt=False)
    m2, g2, _ = _step_grads(tok, grad_ckpt=True)
    assert ro.completion_ids_B_T.is_cuda and ro.n_tokens > 0
    assert abs(m1["loss"] - m2["loss"]) < 1e-6 and torch.isfinite(torch.tensor(m1["loss"]))
    for n in g1:
        assert torch.allclose(g1[n], g2[n], rtol=1e-3, atol=1e-6), n
    assert sum(float(g.abs().sum()) for g in g1.values()) > 0


def test_chunked_logprobs_bound_the_memory():
    """B x T x V fp32 never exists at once: peak extra memory follows the chunk, not T."""
    from opdkit.teacher import token_logprobs

    B, T, H, V = 4, 2048, 64, 32768
    head = torch.nn.Linear(H, V, bias=False, device="cuda")
    h = torch.randn(B, T, H, device="cuda", requires_grad=True)
    ids = torch.randint(0, V, (B, T), device="cuda")
    full_bytes = B * T * V * 4
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp = token_logprobs(head, h, ids, chunk=128)
    logp.sum().backward()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < full_bytes / 4, (peak, full_bytes)
    ref = (h @ head.weight.T).log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    assert torch.allclose(logp, ref, atol=1e-4)

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
    from opdkit.engines.base import left_pad
    from opdkit.engines.static import StaticDecoder

    model = _small(len(tok), arch, dtype=torch.bfloat16)
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4.", "Compute 88-80+17-5."]]
    ids, mask = left_pad(prompts, tok.pad_token_id, "cuda")
    for top_p in (0.95, 1.0):  # the torch sampler and the Gumbel kernel
        kw = dict(temperature=1.0, top_p=top_p, max_new_tokens=300, eos_ids=[-1])  # no EOS: 300 tokens
        graph = StaticDecoder(model)
        a_ids, a_logp = graph.generate(ids, mask, [1, 2, 3], **kw)
        a2_ids, a2_logp = graph.generate(ids, mask, [1, 2, 3], **kw)  # the session's graph replayed again
        b_ids, b_logp = StaticDecoder(model, use_graphs=False).generate(ids, mask, [1, 2, 3], **kw)
        assert graph.stats["captures"] == 1 and graph.stats["kernels"]
        assert torch.equal(a_ids, b_ids) and torch.equal(a_logp, b_logp)
        assert torch.equal(a2_ids, b_ids) and torch.equal(a2_logp, b_logp)


def test_programmatic_dependent_launch_changes_no_sample(tok):
    """The decoder's kernels launched with programmatic dependent launch (Hopper: each launch overlaps the kernel
    before it) against the same kernels launched one after the other: the same ids and log-probs, bit for bit, from
    the CUDA graphs and eagerly (a kernel reading its inputs before the one before had written them would differ)."""
    from opdkit.engines import decode_kernels as dk
    from opdkit.engines.base import left_pad
    from opdkit.engines.static import StaticDecoder

    if not dk.pdl_available("cuda"):
        pytest.skip(f"no programmatic dependent launch here (capability {torch.cuda.get_device_capability()}, "
                    "or a Triton without launch_pdl / gdc_wait)")
    model = _small(len(tok), "qwen2", layers=4, dtype=torch.bfloat16)
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4.", "Compute 88-80+17-5."] * 2]
    ids, mask = left_pad(prompts, tok.pad_token_id, "cuda")
    for tau, top_p in ((1.0, 1.0), (0.6, 0.95)):  # the Gumbel kernel; the torch sampler at the seeds' settings
        kw = dict(temperature=tau, top_p=top_p, max_new_tokens=400, eos_ids=[-1])
        runs = {}
        for pdl in (True, False):
            for graphs in (True, False):
                dec = StaticDecoder(model, pdl=pdl, use_graphs=graphs)
                runs[pdl, graphs] = dec.generate(ids, mask, list(range(6)), **kw)
                assert dec.stats["pdl"] is pdl and dec.stats["kernels"]
        want_ids, want_logp = runs[False, False]
        for key, (got_ids, got_logp) in runs.items():
            assert torch.equal(got_ids, want_ids) and torch.equal(got_logp, want_logp), (tau, top_p, key)
    torch.manual_seed(2)  # the projections at the 1.5B shape, the first block of weights loaded before the wait
    bf = dict(dtype=torch.bfloat16, device="cuda")
    for n_out, n_in in ((2048, 1536), (8960, 1536), (1536, 8960)):
        x, h = torch.randn(8, n_in, **bf), torch.randn(8, 1536, **bf)
        w, b = torch.randn(2 * n_out, n_in, **bf) / n_in ** 0.5, torch.randn(2 * n_out, **bf)
        nw = torch.ones(1536, **bf)
        assert torch.equal(dk.linear(x, w[:n_out], b[:n_out], pdl=True), dk.linear(x, w[:n_out], b[:n_out]))
        assert torch.equal(dk.linear_silu(x, w, b, pdl=True), dk.linear_silu(x, w, b))
        if n_out == 1536:
            got = dk.linear_add_rms_norm(x, w[:n_out], None, h.clone(), nw, 1e-6, pdl=True)
            want = dk.linear_add_rms_norm(x, w[:n_out], None, h.clone(), nw, 1e-6)
            assert all(torch.equal(g, e) for g, e in zip(got, want))


def test_the_gemv_blocks_loaded_before_the_wait_change_no_bit():
    """The projections at the 1.5B shape with the first PRE blocks of weights loaded before the wait (and 4 or 8
    warps: the registers PRE needs), under programmatic dependent launch and without: the bits of the same blocks and
    split launched without PDL in one loop (PRE 0; the blocks summed in the same order)."""
    from opdkit.engines import decode_kernels as dk

    torch.manual_seed(3)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    pdls = (True, False) if dk.pdl_available("cuda") else (False,)
    for n_out, n_in, silu, (bn, bk, split), pres in (
            (2048, 1536, False, (16, 256, 1), (0, 1, 2, 3, 6)), (1536, 1536, False, (16, 256, 1), (2, 6)),
            (8960, 1536, True, (32, 64, 1), (1, 2, 4, 8)), (1536, 8960, False, (64, 256, 4), (1, 2)),
            (1536, 8960, False, (32, 256, 8), (1, 2))):
        x = torch.randn(8, n_in, **bf)
        w = torch.randn((2 if silu else 1) * n_out, n_in, **bf) / n_in ** 0.5
        b = torch.randn(w.shape[0], **bf)
        one_loop = (bn, bk, split, 4, 4, 0)
        want = dk.linear_silu(x, w, b, one_loop) if silu else dk.linear(x, w, b, one_loop)
        for pre in pres:
            for warps in (4, 8):
                for pdl in pdls:
                    config = (bn, bk, split, warps, 4, pre)
                    got = dk.linear_silu(x, w, b, config, pdl) if silu else dk.linear(x, w, b, config, pdl)
                    assert torch.equal(got, want), (n_out, n_in, config, pdl)


def test_fused_graph_decoding_matches_the_modules_forward_in_fp32(tok):
    from opdkit.engines.base import left_pad
    from opdkit.engines.static import StaticDecoder

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _small(len(tok), "qwen3")
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4."]]
    ids, mask = left_pad(prompts, tok.pad_token_id, "cuda")
    kw = dict(temperature=1.0, top_p=1.0, max_new_tokens=200, eos_ids=[-1])
    fast = StaticDecoder(model, dtype=torch.float32)  # fused layers, Triton kernels, CUDA graphs
    a_ids, a_logp = fast.generate(ids, mask, [1, 2], **kw)
    slow = StaticDecoder(model, dtype=torch.float32, use_graphs=False, fused=False)
    b_ids, b_logp = slow.generate(ids, mask, [1, 2], **kw)
    assert fast.stats["fused_layers"] and fast.stats["captures"] == 1
    assert torch.equal(a_ids, b_ids) and (a_logp - b_logp).abs().max() < 1e-4


def test_static_decoder_matches_generate_in_fp32(tok):
    """Same tokens as HF generate (dynamic cache) when both run in fp32: the cache geometry,
    positions, masks and grouped-query attention of the decoder are right."""
    from opdkit.engines.base import left_pad
    from opdkit.engines.hf import HFEngine
    from opdkit.engines.static import StaticDecoder

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
    from opdkit import opd, step as opd_step
    from opdkit.config import config_from_dict
    from opdkit.engines.hf import HFEngine

    cfg = config_from_dict({"loss": {"name": "k1"}, "runtime": {"logprob_chunk": 16, "grad_checkpointing": grad_ckpt}})
    student = _small(len(tok), "qwen2", layers=3, seed=0)
    teacher = _small(len(tok), "qwen2", layers=3, seed=1, dtype=torch.bfloat16).eval().requires_grad_(False)
    if grad_ckpt:
        from opdkit.models import hf_checkpointing

        hf_checkpointing(student, True)
        student.config.use_cache = False
    student.train()
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4."]]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ro = HFEngine(student, tok).sample(prompts, samples_per_prompt=2, seeds=[1, 2, 3, 4], temperature=1.0,
                                           top_p=1.0, max_new_tokens=48)
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16)

    kw = {"rollout": cfg.rollout, "runtime": cfg.runtime, "micro_batch": cfg.optim.micro_batch}
    contexts = opd_step.score_batch(cfg.loss, teacher, batch, autocast, **kw)
    m = opd_step.micro_losses(cfg.loss, student, batch, contexts, autocast, **kw)
    return m, {n: p.grad.clone() for n, p in student.named_parameters()}, ro


def test_bf16_step_with_and_without_gradient_checkpointing(tok):
    m1, g1, ro = _step_grads(tok, grad_ckpt=False)
    m2, g2, _ = _step_grads(tok, grad_ckpt=True)
    assert ro.completion_ids_B_T.is_cuda and ro.n_tokens > 0
    assert abs(m1["loss"] - m2["loss"]) < 1e-6 and torch.isfinite(torch.tensor(m1["loss"]))
    for n in g1:
        assert torch.allclose(g1[n], g2[n], rtol=1e-3, atol=1e-6), n
    assert sum(float(g.abs().sum()) for g in g1.values()) > 0


def test_keeping_the_attention_outputs_saves_the_varlen_flash_attention(tok):
    """runtime.checkpoint_keep_attention on CUDA in bf16: the packed forward's variable-length flash attention
    (torch_attn._varlen_attn) is what the policy saves, and the gradients equal full recomputation's within
    flash attention's own run-to-run variation (its backward sums with atomics)."""
    import test_packing
    from opdkit.engines.base import left_pad
    from opdkit.scoring import build_geometry

    torch.manual_seed(0)
    model = _small(len(tok), "qwen2", layers=2, seed=0).train()
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4."]]
    pid, pmask = left_pad(prompts, tok.pad_token_id, "cuda")
    geo = build_geometry(pid, pmask, torch.randint(5, 30, (2, 40), device="cuda"), torch.ones(2, 40, device="cuda"))
    seen_full, seen_kept = [], []
    with torch.autocast("cuda", dtype=torch.bfloat16):
        full = test_packing._packed_grads(model, geo, False, seen_full)
        kept = test_packing._packed_grads(model, geo, True, seen_kept)
    assert seen_full == [] and len(seen_kept) >= 2 and all("varlen" in op for op in seen_kept), seen_kept
    for n in full:
        assert torch.allclose(full[n], kept[n], rtol=1e-2, atol=1e-5), n


def test_unchecked_layers_on_cuda_keep_what_the_estimate_says_and_the_same_gradients(tok):
    """runtime.unchecked_layers_memory on CUDA, bf16 autocast over fp32 weights, packed rows (varlen flash attention):
    step.uncheck_layers leaves layers unchecked from the free memory; each adds the memory that
    memory.layer_activation_bytes estimates (its input aside, within 25%: allocator rounding; measured on an H200),
    and the gradients equal checkpointing every layer's within flash attention's run-to-run variation (its backward
    sums with atomics; 1% of each gradient's norm)."""
    from opdkit import memory, models, packing, step
    from opdkit.engines.base import left_pad
    from opdkit.scoring import build_geometry

    torch.manual_seed(0)
    model = _small(len(tok), "qwen2", layers=4, seed=0).train()
    models.enable_checkpointing(model, keep_attention=True)
    layers = model.model.layers
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4."]]
    pid, pmask = left_pad(prompts, tok.pad_token_id, "cuda")
    T = 2000
    geo = build_geometry(pid, pmask, torch.randint(5, 30, (2, T), device="cuda"), torch.ones(2, T, device="cuda"))
    tokens = int(geo.attention_mask_B_S.sum())
    c = model.config
    per_layer = tokens * (memory.layer_activation_bytes(c.hidden_size, memory.kv_width(c), c.intermediate_size, 2)
                          - 4 * c.hidden_size)

    def run(n, k=0):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if n is None:
                n, k = step.uncheck_layers(model, geo, 0.9, True, keep_attention=True, chunk=2048)
            else:
                models.checkpoint_all_but_last(layers, n, k)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            h = packing.packed_hidden(model.model, geo.input_ids_B_S, geo.attention_mask_B_S, geo.prompt_width, T)
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - base
        (h.float() * torch.linspace(-1, 1, h.shape[-1], device="cuda")).sum().backward()
        return n, held, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    run(0)  # a first forward allocates what stays (cuBLAS's workspace): not a layer's activations
    n0, held0, g0 = run(0)
    n, held, g = run(None)
    assert n == len(layers)  # a small model: the whole decoder fits the spare memory
    assert 0.75 < n * per_layer / (held - held0) < 1.25, (n * per_layer, held - held0)
    # runtime.checkpoint_keep_matmuls: a layer keeping its matmuls holds the projections' outputs (within 25%)
    _, held_k, g_k = run(0, len(layers))
    kept = tokens * memory.kept_matmul_bytes(c.hidden_size, memory.kv_width(c), c.intermediate_size, 2)
    assert 0.75 < len(layers) * kept / (held_k - held0) < 1.25, (len(layers) * kept, held_k - held0)
    for other in (g, g_k):
        for name in g0:  # (relative to the gradient's norm: flash attention's atomics move entries near 0 the most)
            assert float((g0[name] - other[name]).norm()) <= 1e-2 * float(g0[name].norm()), name


def test_chunked_logprobs_bound_the_memory():
    """B x T x V fp32 never exists at once: peak extra memory follows the chunk, not T."""
    from opdkit.scoring import token_logprobs

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


def test_decode_kernels_in_bf16_equal_their_references():
    """On the GPU, in bf16: the rotary + cache write of the attention kernel round as their reference (exactly),
    the split-length attention is within bf16 rounding of the float32 reference, and the Gumbel kernel picks the
    id policy_scores picks at the real vocabulary size (its float64 scores bit for bit)."""
    from opdkit.engines import decode_kernels as dk
    from opdkit.engines.sampling import sample_seed

    torch.manual_seed(0)
    B, H, K, D, L, inter = 8, 12, 2, 128, 2000, 8960
    bf = dict(dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(B, (H + 2 * K) * D, **bf)
    ang = torch.randn(L, D // 2, device="cuda")
    cos, sin = torch.cat([ang.cos()] * 2, -1).bfloat16(), torch.cat([ang.sin()] * 2, -1).bfloat16()
    pos = torch.randint(0, L, (B,), device="cuda")
    kc, vc = torch.randn(B, K, L, D, **bf), torch.randn(B, K, L, D, **bf)
    start = torch.randint(0, 300, (B,), device="cuda")
    plan = dk.AttentionPlan(B, H, K, D, L, "cuda")
    zero = torch.zeros_like(start)  # short contexts too: the splits share the visible slots of each step
    for start_B, end in ((start, 301), (start, 778), (start, 1000), (start, L), (zero, 8), (zero, 40), (zero, 97)):
        kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        want = dk.rope_attention_ref(qkv, cos, sin, pos, kc1, vc1, start_B, end, D ** -0.5, H, K)
        got = dk.rope_attention(qkv, cos, sin, pos, kc2, vc2, start_B, torch.tensor([end - 7], device="cuda"),
                                D ** -0.5, plan, H, K, end_offset=7)
        assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2) and not torch.equal(kc1, kc)  # the slot, as rounded
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    x, w = torch.randn(B, 1536, **bf) * 3, torch.randn(1536, **bf)
    assert (dk.rms_norm(x, w, 1e-6).float() - dk.rms_norm_ref(x, w, 1e-6).float()).abs().max() <= 2 ** -7 * 12
    r = torch.randn(B, 1536, **bf)
    a_h, a_x = dk.add_rms_norm_ref(x.clone(), r, w, 1e-6)
    b_h, b_x = dk.add_rms_norm(x.clone(), r, w, 1e-6)
    assert torch.equal(a_h, b_h) and (a_x.float() - b_x.float()).abs().max() <= 2 ** -7 * 12
    gu = torch.randn(B, 2 * inter, **bf) * 3
    assert (dk.silu_mul(gu).float() - dk.silu_mul_ref(gu).float()).abs().max() <= 2 ** -7 * 3
    V, n_vocab = 151936, 151665
    seeds = torch.tensor([sample_seed(0, 1, i) for i in range(B)], device="cuda")
    for tau in (1.0, 0.6):
        plan = dk.GumbelPlan(B, n_vocab, tau, "cuda")
        for t in range(0, 2000, 97):
            raw = torch.randn(B, V, device="cuda") * 4
            want = dk.gumbel_argmax_ref(raw, seeds, torch.tensor(t, device="cuda"), tau, n_vocab)
            assert torch.equal(dk.gumbel_argmax(raw, seeds, torch.tensor([t], device="cuda"), plan), want), (tau, t)
            raw16 = raw.bfloat16()  # the LM head's logits as the decoder samples from them (no float32 copy)
            want_ids, want_logp = dk.sample_token_ref(raw16, seeds, torch.tensor(t, device="cuda"), tau, n_vocab)
            ids = torch.zeros((B, t + 2), dtype=torch.int64, device="cuda")
            logp = torch.zeros((B, t + 2), device="cuda")
            tok, pos = torch.zeros(B, dtype=torch.int64, device="cuda"), torch.arange(B, device="cuda")
            done, eos = torch.zeros(B, dtype=torch.bool, device="cuda"), want_ids[:1].clone()
            dk.sample_token(raw16, seeds, torch.tensor([t], device="cuda"), plan, ids, logp, tok, pos, done, eos)
            assert torch.equal(ids[:, t], want_ids) and torch.equal(tok, want_ids), (tau, t)
            assert (logp[:, t] - want_logp).abs().max() < 1e-5 and not logp[:, t + 1].any(), (tau, t)
            assert torch.equal(pos, torch.arange(1, B + 1, device="cuda")), (tau, t)
            assert torch.equal(done, want_ids == eos), (tau, t)


def test_nucleus_sampling_kernels_equal_the_torch_sampler_at_the_real_vocabulary():
    """At top-p < 1, ``sample_token`` (the nucleus search, then the Gumbel kernel over the nucleus) picks the id the
    torch sampler (``policy_scores``: float64 stable sort, softmax, cumulative sum) picks from the bf16 logits at
    the real vocabulary, and records its log pi within float32 rounding: a spread-out row, a peaked one (a nucleus
    of a few ids) and a near-uniform one whose bf16 logits tie in long runs (the nucleus ends inside one), in a
    CUDA graph as the decoder replays it, at the seeds' and the evaluations' settings."""
    from opdkit.engines import decode_kernels as dk
    from opdkit.engines.sampling import sample_seed

    torch.manual_seed(0)
    B, V, n_vocab = 8, 151936, 151665
    seeds = torch.tensor([sample_seed(0, 2, i) for i in range(B)], device="cuda")
    scale = torch.tensor([4.0, 4.0, 12.0, 12.0, 0.05, 0.05, 1.0, 1.0], device="cuda")[:, None]
    for tau, top_p in ((0.6, 0.95), (0.7, 0.9), (1.0, 0.95), (1.1, 0.5)):
        plan = dk.GumbelPlan(B, n_vocab, tau, "cuda", pdl=dk.pdl_available("cuda"), top_p=top_p)
        raw = (torch.randn(B, V, device="cuda") * scale).bfloat16()
        ids, logp = _replayed_samples(raw, seeds, plan, 12)
        for t in range(ids.shape[1]):
            want_ids, want_logp = dk.sample_token_ref(raw, seeds, torch.tensor(t, device="cuda"), tau, n_vocab, top_p)
            assert torch.equal(ids[:, t], want_ids), (tau, top_p, t)
            assert (logp[:, t] - want_logp).abs().max() < 1e-5, (tau, top_p, t)


def _replayed_samples(raw_B_V, seeds_B, plan, T: int):
    """``sample_token`` at t = 0 .. T-1 from the same logits, one step captured in a CUDA graph and replayed T times:
    the ids (B, T) and log-probs (B, T) it wrote."""
    from opdkit.engines import decode_kernels as dk

    B, cuda = raw_B_V.shape[0], dict(device="cuda")
    t_1, ids, logp = torch.zeros(1, dtype=torch.int64, **cuda), torch.zeros((B, T), dtype=torch.int64, **cuda), \
        torch.zeros((B, T), **cuda)
    tok, pos = torch.zeros(B, dtype=torch.int64, **cuda), torch.zeros(B, dtype=torch.int64, **cuda)
    done, eos = torch.zeros(B, dtype=torch.bool, **cuda), torch.tensor([151643], **cuda)

    def step():
        dk.sample_token(raw_B_V, seeds_B, t_1, plan, ids, logp, tok, pos, done, eos)
        t_1.add_(1)

    step()  # compile
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        step()
    t_1.zero_()
    for _ in range(T):
        g.replay()
    torch.cuda.synchronize()
    return ids, logp


def test_gemv_kernels_in_bf16_round_as_their_references_at_the_real_shape():
    """The decode projections' GEMV kernels (each configuration ``gemv_config`` picks at the 1.5B shape, split
    or not) against the float32-accumulated reference: within one bf16 rounding of each output, two for
    silu * up (the sums run in another order), and the same bits on a second call (no atomics: deterministic)."""
    from opdkit.engines import decode_kernels as dk

    torch.manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    for rows in (1, 8, 16):
        for n_out, n_in, bias, silu in ((2048, 1536, True, False), (1536, 1536, False, False),
                                        (8960, 1536, False, True), (1536, 8960, False, False)):
            x = torch.randn(rows, n_in, **bf)
            w = torch.randn((2 if silu else 1) * n_out, n_in, **bf) / n_in ** 0.5
            b = torch.randn(w.shape[0], **bf) if bias else None
            if silu:
                got, want = dk.linear_silu(x, w, b), dk.linear_silu_ref(x, w, b)
            else:
                got, want = dk.linear(x, w, b), dk.linear_ref(x, w, b)
            err = (got.float() - want.float()).abs()
            rel = 2 ** -6 if silu else 2 ** -7  # silu * up rounds three times after the sums
            assert (err <= rel * want.float().abs() + 1e-3).all(), (rows, n_out, n_in, float(err.max()))
            again = dk.linear_silu(x, w, b) if silu else dk.linear(x, w, b)
            assert torch.equal(got, again)


def test_the_split_projections_sum_add_and_norm_in_one_kernel_give_the_bits_of_three():
    """``linear_add_rms_norm`` (the down / output projection's partials summed in the kernel of the residual add and
    the norm) against the same projection, ``gemv_reduce`` and ``add_rms_norm`` as three launches: the same bits, for
    split and unsplit configurations at the 1.5B shape."""
    from opdkit.engines import decode_kernels as dk

    torch.manual_seed(1)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    for rows in (1, 8, 16):
        for n_out, n_in, bias in ((1536, 8960, False), (1536, 1536, False), (1536, 8960, True)):
            x, h = torch.randn(rows, n_in, **bf), torch.randn(rows, n_out, **bf) * 4
            w, nw = torch.randn(n_out, n_in, **bf) / n_in ** 0.5, torch.randn(n_out, **bf)
            b = torch.randn(n_out, **bf) if bias else None
            for config in (None, (64, 256, 4, 4, 4), (64, 256, 8, 4, 4), (16, 256, 1, 4, 4)):
                h1, h2 = h.clone(), h.clone()
                want_h, want = dk.add_rms_norm(h1, dk.linear(x, w, b, config), nw, 1e-6)
                got_h, got = dk.linear_add_rms_norm(x, w, b, h2, nw, 1e-6, config)
                assert got_h is h2 and torch.equal(got_h, want_h) and torch.equal(got, want), (rows, n_in, config)


def test_packed_rows_equal_row_by_row_with_gradients():
    """runtime.unpadded_rows on CUDA: the rows as one packed forward (varlen FlashAttention) give each
    row's hidden states and the same gradients as running each row alone."""
    from opdkit import packing
    from opdkit.engines.base import left_pad
    from opdkit.scoring import build_geometry, completion_hidden

    if not packing.varlen_available(torch.device("cuda")):
        pytest.skip("this torch has no torch.nn.attention.varlen")
    from opdkit.models import hf_checkpointing

    model = _small(4096, "qwen3", layers=2, seed=3)
    hf_checkpointing(model, True)
    model.train()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (7, 30, 12, 19)]
    pid, pmask = left_pad(prompts, 0, "cuda")
    comp = torch.randint(5, 4000, (4, 40), generator=g).cuda()
    cmask = torch.ones(4, 40, device="cuda")
    cmask[1, 25:] = 0
    cmask[3, 3:] = 0
    geo = build_geometry(pid, pmask, comp, cmask)
    out = {}
    for mode in ("packed", "per_row"):
        model.zero_grad()
        orig = packing.varlen_available
        packing.varlen_available = (lambda d, m=mode, f=orig: m == "packed" and f(d))
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                h = completion_hidden(model, geo, unpadded=True)
            (h.float() * torch.linspace(-1, 1, h.shape[-1], device="cuda")).sum().backward()
        finally:
            packing.varlen_available = orig
        out[mode] = (h.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (hp, gp), (hr, gr) = out["packed"], out["per_row"]
    assert (hp - hr).abs().max() <= 0.02 * hr.abs().max()
    for n in gr:
        assert (gp[n] - gr[n]).norm() <= 0.02 * gr[n].norm() + 1e-6, n

"""Run by tests/test_decode_kernels.py in a process of its own with TRITON_INTERPRET=1 (Triton's
interpreter runs the kernels of opdkit.engines.decode_kernels on CPU tensors; it must be set before
Triton is imported). Each check compares a kernel with its torch reference (float32: the interpreter
rounds float32 -> bf16 toward zero, not to nearest, so bf16 is checked on the GPU, tests/test_gpu.py),
and the whole fused decoder with kernels against HF generate. Prints one line per check; exits 1 on a
failure."""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from opdkit.engines import decode_kernels as dk  # noqa: E402

failures = []


def _patch_the_language_once_a_launch() -> None:
    """Triton's interpreter patches ``triton.language`` (its builtins wrapped for the interpreter, a few functions
    replaced) when a kernel launch starts, and restores it when the launch ends; it patches again on every call of a
    ``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__``), scanning the language modules with
    ``inspect.getmembers`` each time: a third of this script's seconds. Inside a launch that second patch changes
    nothing: the builtins it would wrap are wrapped already (what it finds no longer carries Triton's builtin mark),
    and what it sets unconditionally are stateless functions equal to those the launch set, which the launch's
    restore puts back anyway. So a helper that sees only the language modules its launch patched is called without
    it. The kernels run the same Python, on the same patched language; a Triton whose interpreter lacks these
    internals is left as it is."""
    try:
        from triton.runtime import interpreter as ti

        real_patch, Scope, tl = ti._patch_lang, ti._LangPatchScope, ti.tl
    except (ImportError, AttributeError):
        return
    launch = {"langs": None}  # the language modules the launch under way patched (None: no launch)

    def langs_of(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_lang(fn):
        if launch["langs"] is not None and langs_of(fn) <= launch["langs"]:
            return Scope()  # a helper inside the launch: patched already, nothing to restore
        scope = real_patch(fn)
        if launch["langs"] is None:  # a launch: patched until its restore
            launch["langs"], restore = langs_of(fn), scope.restore

            def restore_and_end():
                launch["langs"] = None
                restore()

            scope.restore = restore_and_end
        return scope

    ti._patch_lang = patch_lang


_patch_the_language_once_a_launch()


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        failures.append(name)


def kernels() -> None:
    torch.manual_seed(0)
    B, H, K, D, L, inter, V = 3, 6, 2, 32, 300, 40, 5000
    qkv = torch.randn(B, (H + 2 * K) * D)
    ang_P = torch.randn(400, D // 2)
    cos, sin = torch.cat([ang_P.cos()] * 2, -1), torch.cat([ang_P.sin()] * 2, -1)
    pos = torch.tensor([5, 17, 399])
    kc, vc = torch.randn(B, K, L, D), torch.randn(B, K, L, D)
    for programs, block_n in ((4, 64), (24, 64), (512, 32), (512, 16)):  # 1, 2, 4 and 7 splits; smaller blocks
        plan = dk.AttentionPlan(B, H, K, D, L, "cpu", programs=programs, block_n=block_n)
        for start, end in (([0, 40, 250], 260), ([0, 0, 0], 1), ([299, 10, 0], 300), ([0, 5, 9], 64), ([3, 3, 3], 65)):
            kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            want = dk.rope_attention_ref(qkv, cos, sin, pos, kc1, vc1, torch.tensor(start), end, D ** -0.5, H, K)
            got = dk.rope_attention(qkv, cos, sin, pos, kc2, vc2, torch.tensor(start), torch.tensor([end - 7]),
                                    D ** -0.5, plan, H, K, end_offset=7)
            err = float((want - got).abs().max())
            caches = torch.equal(kc1, kc2) and torch.equal(vc1, vc2) and not torch.equal(kc1, kc)
            check(f"rope_attention splits={plan.nsplit} block={block_n} start={start} end={end}", caches and err < 1e-5,
                  f"max err {err:.2e}, caches {'as the reference' if caches else 'DIFFER'}")
    x, w = torch.randn(B, 96) * 3, torch.randn(96)
    err = float((dk.rms_norm_ref(x, w, 1e-6) - dk.rms_norm(x, w, 1e-6)).abs().max())
    check("rms_norm", err < 1e-5, f"max err {err:.2e}")
    h1, r = torch.randn(B, 96), torch.randn(B, 96)
    h2 = h1.clone()
    a_h, a_x = dk.add_rms_norm_ref(h1, r, w, 1e-6)
    b_h, b_x = dk.add_rms_norm(h2, r, w, 1e-6)
    err = float((a_x - b_x).abs().max())
    check("add_rms_norm", torch.equal(a_h, b_h) and torch.equal(h2, h1) and err < 1e-5, f"max err {err:.2e}")
    gu = torch.randn(B, 2 * inter) * 4
    err = float((dk.silu_mul_ref(gu) - dk.silu_mul(gu)).abs().max())
    check("silu_mul", err < 1e-6, f"max err {err:.2e}")
    for rows, n_out, n_in, bias in ((3, 70, 96, True), (8, 40, 300, False)):
        x = torch.randn(rows, n_in) * 2  # outputs of order 1: the check's tolerance is absolute
        w_N_K, w_2N_K = torch.randn(n_out, n_in) / n_in ** 0.5, torch.randn(2 * n_out, n_in) / n_in ** 0.5
        b_N, b_2N = (torch.randn(n_out), torch.randn(2 * n_out)) if bias else (None, None)
        # 1, 4, 2 and 3 splits (the rows of a block masked; 3: a split count that is no power of 2, its last split
        # partly past the inputs)
        for config in (None, (16, 64, 4, 4, 3), (32, 64, 2, 4, 3), (16, 64, 3, 4, 3)):
            want, got = dk.linear_ref(x, w_N_K, b_N), dk.linear(x, w_N_K, b_N, config)
            err = float((want - got).abs().max())
            want, got = dk.linear_silu_ref(x, w_2N_K, b_2N), dk.linear_silu(x, w_2N_K, b_2N, config)
            err2 = float((want - got).abs().max())
            check(f"linear / linear_silu {rows}x{n_in}->{n_out} bias={bias} config={config}",
                  err < 1e-5 and err2 < 1e-5, f"max err {err:.1e} / {err2:.1e}")
            h, nw = torch.randn(rows, n_out), torch.randn(n_out)
            h1, h2 = h.clone(), h.clone()
            want_h, want = dk.linear_add_rms_norm_ref(x, w_N_K, b_N, h1, nw, 1e-6)
            got_h, got = dk.linear_add_rms_norm(x, w_N_K, b_N, h2, nw, 1e-6, config)
            err, err_h = float((want - got).abs().max()), float((want_h - got_h).abs().max())
            check(f"linear_add_rms_norm {rows}x{n_in}->{n_out} bias={bias} config={config}",
                  got_h is h2 and err_h < 1e-5 and err < 1e-4, f"max err {err_h:.1e} (h) / {err:.1e} (normed)")
    # the first PRE blocks of weights loaded before the inputs (under PDL: before the wait) change no bit: 300 inputs
    # are 5 blocks of 64, the last one masked; one split and two
    for split in (1, 2):
        def both(pre, split=split):
            config = (16, 64, split, 4, 3, pre)
            return dk.linear(x, w_N_K, b_N, config), dk.linear_silu(x, w_2N_K, b_2N, config)

        one_loop, pres = both(0), ((1, 2, 5) if split == 1 else (1, 3))
        same = all(all(map(torch.equal, both(p), one_loop)) for p in pres)
        check(f"gemv PRE {pres} blocks first, {split} split(s): the bits of one loop", same)
    raw = torch.randn(B, V) * 3
    seeds = torch.tensor([1, 2 ** 62 + 5, 7])
    for tau in (1.0, 0.6, 1.1):
        plan = dk.GumbelPlan(B, V - 100, tau, "cpu")
        same = all(torch.equal(dk.gumbel_argmax_ref(raw, seeds, t, tau, V - 100),
                               dk.gumbel_argmax(raw, seeds, torch.tensor([t]), plan)) for t in (0, 1, 7, 1000, 2 ** 40))
        check(f"gumbel_argmax tau={tau}", same)
        for dtype in (torch.float32, torch.bfloat16):  # the logits as the LM head gives them: no float32 copy
            raw_d = raw.to(dtype)
            T, eos = 6, torch.tensor([5, 17])
            ids, logp = torch.zeros((B, T), dtype=torch.int64), torch.zeros((B, T))
            tok, pos = torch.zeros(B, dtype=torch.int64), torch.tensor([3, 9, 40])
            done = torch.tensor([False, True, False])
            ok, err = True, 0.0
            for t in (0, 4):
                want_ids, want_logp = dk.sample_token_ref(raw_d, seeds, t, tau, V - 100)
                pos0, done0 = pos.clone(), done.clone()
                dk.sample_token(raw_d, seeds, torch.tensor([t]), plan, ids, logp, tok, pos, done, eos)
                err = max(err, float((logp[:, t] - want_logp).abs().max()))
                ok &= (torch.equal(ids[:, t], want_ids) and torch.equal(tok, want_ids) and torch.equal(pos, pos0 + 1)
                       and torch.equal(done, done0 | torch.isin(want_ids, eos)))
            untouched = torch.equal(ids[:, [1, 2, 3, 5]], torch.zeros((B, 4), dtype=torch.int64))
            check(f"sample_token tau={tau} {dtype}", ok and untouched and err < 2e-6, f"max log-prob err {err:.1e}")
    # the end test: an id that is one of the end ids sets its row's done flag (and only that row's)
    plan = dk.GumbelPlan(B, V - 100, 1.0, "cpu")
    want_ids, _ = dk.sample_token_ref(raw, seeds, 2, 1.0, V - 100)
    done = torch.zeros(B, dtype=torch.bool)
    dk.sample_token(raw, seeds, torch.tensor([2]), plan, torch.zeros((B, 3), dtype=torch.int64), torch.zeros((B, 3)),
                    torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64), done, want_ids[1:2])
    check("sample_token end ids", done.tolist() == [bool(i == want_ids[1]) for i in want_ids.tolist()])
    # top-p < 1: the nucleus search against policy_scores' stable sort. Row 0's nucleus ends inside a run of 595
    # equal logits spread over every block (+0 and -0 among them: equal), so a count off by one moves its log pi;
    # row 1 is near-uniform (most ids in the nucleus), row 2 spread out
    Vn = 1200
    run = torch.zeros(Vn, dtype=torch.bool)
    run[10::2] = True
    row0 = torch.where(run, 0.0, -3.0)
    row0[:4] = 2.0
    row0[run.nonzero()[::7, 0]] = -0.0
    raw = torch.stack([row0, torch.randn(Vn) * 0.01, torch.randn(Vn) * 3])
    for dtype in (torch.bfloat16, torch.float16):  # the nucleus search reads 16-bit logits
        for tau, top_p in ((1.0, 0.5), (0.6, 0.95)):
            # chunks of 8,192 sort keys but once (the default 256 at the seeds' 0.6 / 0.95 in bf16): the interpreter
            # runs the chunk-mass kernel's 256 programs a row in Python, ~6 s a step; the search is the same
            chunk = None if (dtype, tau) == (torch.bfloat16, 0.6) else 8192
            plan = dk.GumbelPlan(B, Vn - 3, tau, "cpu", block=256, top_p=top_p, chunk=chunk)
            ids, logp = torch.zeros((B, 2), dtype=torch.int64), torch.zeros((B, 2))
            ok, err = True, 0.0
            for t in (0, 1):
                want_ids, want_logp = dk.sample_token_ref(raw.to(dtype), seeds, t, tau, Vn - 3, top_p)
                zeros = torch.zeros(B, dtype=torch.int64)
                dk.sample_token(raw.to(dtype), seeds, torch.tensor([t]), plan, ids, logp, zeros, zeros.clone(),
                                torch.zeros(B, dtype=torch.bool), eos)
                ok &= torch.equal(ids[:, t], want_ids)
                err = max(err, float((logp[:, t] - want_logp).abs().max()))
            check(f"sample_token top_p={top_p} tau={tau} {dtype} chunk={plan.CH}", ok and err < 2e-6,
                  f"max log-prob err {err:.1e}")


def decoder() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from opdkit.embedded.tokenizer import build_tokenizer
    from opdkit.engines.base import left_pad
    from opdkit.engines.decode_kernels import pdl_available as dk_pdl
    from opdkit.engines.hf import HFEngine
    from opdkit.engines.sampling import sample_seed
    from opdkit.engines.static import StaticDecoder

    tok = build_tokenizer()
    kw = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4.", "Compute 88-80+17-5."]]
    for name, model, top_p, tau, calls, gemv in (  # (the interpreter runs each kernel launch in Python: kept short)
            ("qwen3 (q/k norms), Gumbel kernel", Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=8)), 1.0, 0.7, 2, True),
            ("qwen2 (biases), top-p sampling", Qwen2ForCausalLM(Qwen2Config(**kw)), 0.9, 1.0, 1, True),
            ("qwen2, cuBLAS projections", Qwen2ForCausalLM(Qwen2Config(**kw)), 1.0, 0.7, 1, False)):
        torch.manual_seed(1)
        model.eval()
        G, T = 1, 14
        seeds = [sample_seed(7, 3, i) for i in range(len(prompts) * G)]
        ro = HFEngine(model, tok, static_cache=False).sample(prompts, samples_per_prompt=G, seeds=seeds,
                                                             temperature=tau, top_p=top_p, max_new_tokens=T)
        ids, mask = left_pad([p for p in prompts for _ in range(G)], tok.pad_token_id)
        dec = StaticDecoder(model, dtype=torch.float32, kernels=True, steps_per_graph=4, prompt_slots=8, gemv=gemv)
        for call in range(calls):  # a second call reuses the session's buffers
            out, logp = dec.generate(ids, mask, seeds, temperature=tau, top_p=top_p, max_new_tokens=T,
                                     eos_ids=[tok.eos_token_id], check_every=8)
            m = ro.completion_mask_B_T.bool()
            W = m.shape[1]
            same = out.shape[1] >= W and torch.equal(out[:, :W][m], ro.completion_ids_B_T[m])
            err = float((logp[:, :W][m] - ro.sampling_logp_B_T[m]).abs().max()) if same else float("nan")
            check(f"decoder {name} call {call}: tokens as generate, log-probs", same and err < 1e-5,
                  f"max err {err:.2e}")
        check(f"decoder {name}: launched one kernel after the other (no programmatic dependent launch off CUDA)",
              dec.stats["pdl"] is False and not dk_pdl("cpu"))


if __name__ == "__main__":
    kernels()
    decoder()
    sys.exit(1 if failures else 0)

"""GPU benchmark of one OPD step at real shapes, with random-init models built on the GPU.

    python bench/opd_bench.py roofline --out r.json          # copy bandwidth, bf16 matmul rate
    python bench/opd_bench.py decode-check --out d.json      # decoded rows vs decode batch (8 vs 2 x 4)
    python bench/opd_bench.py s1 --steps 3 --out s1.json     # S1 recipe, Qwen2-1.5B shape, full FT
    python bench/opd_bench.py s2 --steps 3 --out s2.json     # S2 recipe, Qwen3-1.7B shape, LoRA
    python bench/opd_bench.py trl --steps 1 --out trl.json   # TRL DistillationTrainer, S1 shape/batch
    python bench/report.py r.json s1.json s2.json trl.json   # the markdown table

Each opdkit step is the training loop's step (``opdkit.train``) spelled out with the same library
calls (rollout engine, ``step.score_batch``, ``step.micro_losses``, AdamW), with a device sync
between phases so each phase's seconds are its own. Random-init models practically never emit
EOS, so every sample runs to the token cap: the worst case for the rollout.
Prompts are random token ids of realistic lengths; the tokenizer is a word-level stand-in of the
real vocabulary size ("t123" is token 123).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opdkit import opd, step as opd_step  # noqa: E402
from opdkit.engines.base import left_pad  # noqa: E402
from opdkit.engines.select import engine_name, make_engine  # noqa: E402
from opdkit.engines.weights import plain  # noqa: E402
from opdkit.models import hf_checkpointing, random_model, setup_torch, shape_config  # noqa: E402
from opdkit.recipes import load_config  # noqa: E402
from opdkit.schedules import lr_at  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EOS_ID = 151643  # Qwen's <|endoftext|>: eos and pad
PEAK_BF16 = 989.4e12  # H100/H200 SXM dense bf16 datasheet rate, the MFU denominator


def stand_in_tokenizer(vocab_size: int, eos_id: int = EOS_ID):
    """Word-level tokenizer over ``vocab_size`` ids: "t<i>" -> i; EOS = pad = ``eos_id``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab["<|endoftext|>"] = vocab.pop(f"t{eos_id}")
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.padding_side = "left"
    return tok


def random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 150000) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


DEVICE = "cuda"  # --device cpu: a dry run of the script's logic on tiny shapes


def sync() -> float:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def peak_gib() -> float:
    return gib(torch.cuda.max_memory_allocated()) if DEVICE == "cuda" else 0.0


def gib(n_bytes: float) -> float:
    return round(n_bytes / 2**30, 2)


def model_facts(model) -> dict:
    """Parameter counts and per-token matmul FLOPs of a (possibly peft-wrapped) causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    params = {n: p for n, p in base.named_parameters() if "lora_" not in n}
    n_total = sum(p.numel() for p in params.values())
    n_embed = base.get_input_embeddings().weight.numel()
    n_head = cfg.vocab_size * cfg.hidden_size
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    n_body = n_total - n_embed - (0 if tied else n_head)  # decoder layers + norms
    d_attn = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return {"n_params": n_total, "n_body": n_body, "n_head": n_head, "tied": tied, "layers": cfg.num_hidden_layers,
            "d_attn": d_attn, "decode_read_bytes_bf16": 2 * (n_body + n_head)}  # a decode step reads body + head


def forward_flops(f: dict, seq_lens: list[int], head_tokens: int) -> float:
    """Forward FLOPs: 2*N_body per token, 2*V*H per head token, causal attention 2*S^2*d per layer."""
    return (2 * f["n_body"] * sum(seq_lens) + 2 * f["n_head"] * head_tokens
            + 2 * f["layers"] * f["d_attn"] * sum(s * s for s in seq_lens))


# ----------------------------------------------------------------------------- roofline


def copy_bandwidth(device="cuda", numel: int = 2**29, warmup: int = 3, reps: int = 20) -> float:
    """Device-to-device copy bandwidth of ``numel`` fp32 (bytes read + written per second), median of
    ``reps`` after ``warmup`` copies; NaN off CUDA."""
    if torch.device(device).type != "cuda":
        return float("nan")
    x = torch.randn(numel, device=device, dtype=torch.float32)
    y = torch.empty_like(x)
    times = []
    for i in range(warmup + reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b) / 1e3)
    return 2 * numel * 4 / sorted(times)[len(times) // 2]


def roofline(args) -> dict:
    copy_bw = copy_bandwidth("cuda")  # 2 GiB, median of 20
    n = 8192
    a_, b_ = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
              torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
    for _ in range(3):
        a_ @ b_
    t0 = sync()
    for _ in range(10):
        a_ @ b_
    mm = 10 * 2 * n**3 / (sync() - t0)
    # launch cost: 2,000 one-element kernels, launched one by one, and replayed from a CUDA graph
    z = torch.zeros(1, device="cuda")
    t0 = sync()
    for _ in range(2000):
        z.add_(1)
    launch_s = (sync() - t0) / 2000
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        z.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        for _ in range(2000):
            z.add_(1)
    g.replay()
    t0 = sync()
    for _ in range(5):
        g.replay()
    node_s = (sync() - t0) / 10000
    return {"what": "roofline", "device": torch.cuda.get_device_name(), "copy_bw_Bps": copy_bw, "matmul_bf16_flops": mm,
            "eager_launch_us": launch_s * 1e6, "graph_node_us": node_s * 1e6,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__}


# ----------------------------------------------------------------------------- decoding


def decode_check(args) -> dict:
    """Are decoded rows independent of the decode batch? 8 rows at once vs 2 calls of 4 (same seeds),
    and decode steps/s of the static-cache decoder at batch 8 and 4."""
    from opdkit.engines.static import StaticDecoder

    T = args.max_new_tokens or 512
    mcfg = shape_config("qwen2-1.5b", eos_token_id=EOS_ID, pad_token_id=EOS_ID, bos_token_id=None,
                        **dict(args.shape_kw))
    model = random_model(mcfg, DEVICE, torch.bfloat16, seed=0)
    dec = StaticDecoder(model)
    prompts = random_prompts(2, 180, 260, seed=0)
    rows = [p for p in prompts for _ in range(4)]
    seeds = list(range(100, 108))
    out = {"what": "decode_check", "max_new_tokens": T}

    def go(lo, hi):
        ids, mask = left_pad(rows[lo:hi], EOS_ID, DEVICE)
        t0 = sync()
        tok, logp = dec.generate(ids, mask, seeds[lo:hi], temperature=1.0, top_p=1.0, max_new_tokens=T,
                                 eos_ids=[EOS_ID])
        return tok, logp, dec.stats["decode_steps"] / (sync() - t0)

    go(0, 8)  # warm-up (cuBLAS, allocator)
    tok8, logp8, out["steps_per_s_b8"] = go(0, 8)
    a, b = go(0, 4), go(4, 8)
    out["steps_per_s_b4"] = a[2]
    tok4, logp4 = torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])
    same_B_T = tok8 == tok4
    first = [int((~r).nonzero()[0]) if not bool(r.all()) else T for r in same_B_T]
    out.update(token_agreement=float(same_B_T.float().mean()), first_divergence=first,
               max_abs_dlogp_before_divergence=max(float((logp8[i, :f] - logp4[i, :f]).abs().max()) if f else 0.0
                                                   for i, f in enumerate(first)))
    return out


# ----------------------------------------------------------------------------- opdkit steps


def run_opd(args, *, recipe: str, shape: str, prompt_len: tuple[int, int], solution_len: tuple[int, int]) -> dict:
    overrides = list(args.set)
    if args.max_new_tokens:
        overrides.append(f"rollout.max_new_tokens={args.max_new_tokens}")
    cfg = load_config(ROOT / "params.yaml", ROOT / "recipes" / recipe, overrides)
    R, dev = cfg.rollout, torch.device(DEVICE)
    setup_torch(cfg.runtime)
    tok = stand_in_tokenizer(151936)
    mcfg = shape_config(shape, eos_token_id=EOS_ID, pad_token_id=EOS_ID, bos_token_id=None, **dict(args.shape_kw))
    t_setup = time.perf_counter()
    student = random_model(mcfg, dev, torch.float32, seed=0)  # fp32 master weights; bf16 compute by autocast
    if cfg.runtime.grad_checkpointing:
        hf_checkpointing(student, True)
        student.config.use_cache = False
    teacher_ctx = None
    if cfg.lora.enabled:
        from opdkit.setup import _wrap_lora

        student = _wrap_lora(cfg, student)
    student.train()
    if cfg.teacher.source == "model":
        teacher = random_model(mcfg, dev, torch.bfloat16, seed=1).eval().requires_grad_(False)
    elif cfg.teacher.source == "privileged_fixed" and cfg.lora.enabled:
        teacher, teacher_ctx = student, student.disable_adapter  # the frozen base: the initial student
    else:
        raise SystemExit(f"bench: teacher.source={cfg.teacher.source} without LoRA is not benchmarked here")
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay,
                            fused=DEVICE == "cuda")
    if engine_name(cfg, dev) == "vllm":  # vLLM builds the architecture from a directory (weights are pushed)
        cfg_dir = Path(f"/tmp/opd_bench_{shape}")
        mcfg.architectures = [type(plain(student)).__name__]  # else vLLM guesses (a Qwen3 config became a pooler)
        mcfg.save_pretrained(cfg_dir)
        plain(student).config._name_or_path = str(cfg_dir)
    engine = make_engine(cfg, student, tok)
    engine.sync_weights(student)
    engine_stats = dict(getattr(engine, "stats", {}))

    def autocast():
        return torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda")

    P, G = R.prompts_per_step, R.samples_per_prompt
    pool = random_prompts(4 * P, *prompt_len, seed=0)
    solutions = random_prompts(4 * P, *solution_len, seed=1)
    facts = model_facts(student)
    setup_s = sync() - t_setup
    steps = []
    for step in range(args.steps):
        lr = lr_at(cfg.optim.schedule, step=step, total_steps=max(1, args.steps), elapsed_s=0.0, budget_s=1.0,
                   lr=cfg.optim.lr, min_lr=cfg.optim.min_lr, warmup_steps=cfg.optim.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = [(step * P + i) % len(pool) for i in range(P)]
        prompts = [pool[i] for i in idx]
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        prof = None
        t0 = sync()
        with autocast():
            ro = engine.sample(prompts, samples_per_prompt=G, seeds=opd.step_seeds(cfg.seed, step, P * G),
                               temperature=R.temperature, top_p=R.top_p, max_new_tokens=R.max_new_tokens)
        t1 = sync()
        if args.profile and step == args.steps - 1:  # teacher scoring + update of the last step
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        if cfg.teacher.source == "model":
            t_ids, t_mask = ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp
        else:  # privileged: the teacher's prompt also holds the reference solution
            t_ids, t_mask = left_pad([pool[i] + solutions[i] for i in idx for _ in range(G)], EOS_ID, dev)
        batch = opd.Batch(ro, t_ids, t_mask)
        step_settings = {"rollout": cfg.rollout, "runtime": cfg.runtime, "micro_batch": cfg.optim.micro_batch}
        contexts = opd_step.score_batch(cfg.loss, teacher, batch, autocast,
                                        teacher_ctx or __import__("contextlib").nullcontext, **step_settings)
        t2 = sync()
        m = opd_step.micro_losses(cfg.loss, student, batch, contexts, autocast, **step_settings)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = sync()
        engine.sync_weights(student)  # the next rollout samples the new weights (a copy for the decoder / vLLM)
        t4 = sync()
        if prof is not None:
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60),
                  flush=True)
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            print(json.dumps({"profiled_kernels": len(kernels), "kernel_s": sum(e.device_time for e in kernels) / 1e6,
                              "wall_s": t3 - t1}), flush=True)
        B, T = ro.completion_ids_B_T.shape
        comp_len = ro.completion_mask_B_T.sum(1).long().tolist()
        s_lens = [int(ro.prompt_mask_B_Sp[b].sum()) + comp_len[b] for b in range(B)]
        t_lens = [int(t_mask[b].sum()) + comp_len[b] for b in range(B)]
        n_tok = sum(comp_len)
        upd_flops = 3 * forward_flops(facts, s_lens, n_tok)  # fwd + bwd (2x fwd); recompute not counted
        score_flops = forward_flops(facts, t_lens, n_tok)
        dec = engine.decoder.stats if getattr(engine, "decoder", None) is not None else {}
        row = {
            "step": step + 1, "rows": B, "new_tokens_cap": R.max_new_tokens, "completion_width": T,
            "tokens": n_tok, "truncated_frac": float(ro.truncated_B.float().mean()),
            "rollout_s": t1 - t0, "score_s": t2 - t1, "update_s": t3 - t2, "sync_s": t4 - t3, "step_s": t4 - t0,
            "decode_steps_per_s": dec.get("decode_steps", T) / (t1 - t0), "cuda_graphs": dec.get("graphs"),
            "train_tokens_per_s": sum(s_lens) / (t3 - t2), "update_mfu": upd_flops / (t3 - t2) / PEAK_BF16,
            "score_mfu": score_flops / (t2 - t1) / PEAK_BF16,
            "peak_alloc_gib": peak_gib(), "loss": m["loss"], "kl": m.get("kl"), "grad_norm": float(grad_norm),
        }
        print(json.dumps(row), flush=True)
        steps.append(row)
    return {"what": recipe, "shape": shape, "recipe": recipe, "setup_s": setup_s, "facts": facts,
            "engine": engine_name(cfg, dev), "engine_stats": engine_stats,
            "lora": cfg.lora.enabled, "trainable_params": sum(p.numel() for p in params), "steps": steps,
            "config": {"P": P, "G": G, "max_new_tokens": R.max_new_tokens, "loss": cfg.loss.name,
                       "grad_checkpointing": cfg.runtime.grad_checkpointing, "logprob_chunk": cfg.runtime.logprob_chunk,
                       "micro_batch": cfg.optim.micro_batch, "unpadded_rows": cfg.runtime.unpadded_rows,
                       "rollout_batch_size": cfg.rollout.batch_size}}


# ----------------------------------------------------------------------------- TRL


def run_trl(args) -> dict:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    T = args.max_new_tokens or 7168
    torch.backends.cuda.enable_cudnn_sdp(False)  # as opdkit does (models.setup_torch): same attention kernels
    tok = stand_in_tokenizer(151936)
    mcfg = shape_config("qwen2-1.5b", eos_token_id=EOS_ID, pad_token_id=EOS_ID, bos_token_id=None,
                        **dict(args.shape_kw))
    dtype = torch.bfloat16 if args.trl_bf16 else torch.float32
    student = random_model(mcfg, DEVICE, dtype, seed=0)
    teacher = random_model(mcfg, DEVICE, torch.bfloat16, seed=1).eval().requires_grad_(False)
    # the S1 batch: 2 prompts x 4 samples; TRL samples once per row, so each prompt appears 4 times
    prompts = random_prompts(2, 180, 260, seed=0)
    rows = [{"prompt": " ".join(f"t{i}" for i in p)} for p in prompts for _ in range(4)] * max(1, args.steps)
    conf = DistillationConfig(
        output_dir="/tmp/trl_bench", per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=args.steps,
        learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, max_completion_length=T, temperature=1.0,
        beta=1.0, bf16=True, gradient_checkpointing=True, logging_steps=1, report_to="none", save_strategy="no",
        seed=0, dataloader_num_workers=0, shuffle_dataset=False, cache_implementation=args.trl_cache or None,
        max_grad_norm=1.0, use_cpu=DEVICE == "cpu",
    )
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=conf,
                                  train_dataset=Dataset.from_list(rows), processing_class=tok)
    times: dict = {"generate_s": [], "step_s": [], "tokens": []}
    orig = trainer._generate_single_turn

    def timed(*a, **k):
        t0 = sync()
        out = orig(*a, **k)
        times["generate_s"].append(sync() - t0)
        times["tokens"].append(sum(len(c) for c in out))
        print(json.dumps({"trl_generate_s": times["generate_s"][-1], "tokens": times["tokens"][-1],
                          "peak_alloc_gib": peak_gib()}), flush=True)
        return out

    trainer._generate_single_turn = timed

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = sync()

        def on_step_end(self, *a, **k):
            times["step_s"].append(sync() - self.t0)
            print(json.dumps({"trl_step_s": times["step_s"][-1], "generate_s": times["generate_s"][-1]}), flush=True)

    trainer.add_callback(StepTimer())
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    failure = None
    try:
        trainer.train()
    except torch.OutOfMemoryError as e:  # reported, not hidden: TRL's full-vocabulary loss at long lengths
        failure = f"OutOfMemoryError: {str(e).splitlines()[0]}"
        print(json.dumps({"trl_failure": failure, "peak_alloc_gib": peak_gib()}), flush=True)
    peak = peak_gib()
    # TRL scores with the teacher inside its loss: its "update" is teacher scoring + update
    steps = [{"step": i + 1, "step_s": s, "rollout_s": g, "update_s": s - g, "tokens": n, "decode_steps_per_s": T / g,
              "peak_alloc_gib": peak}
             for i, (s, g, n) in enumerate(zip(times["step_s"], times["generate_s"], times["tokens"]))]
    return {"what": "trl", "trl": trl.__version__, "student_dtype": str(dtype),
            "cache_implementation": conf.cache_implementation, "gradient_checkpointing": True, "max_new_tokens": T,
            "steps": steps, "generate_s": times["generate_s"], "generated_tokens": times["tokens"], "failure": failure,
            "peak_alloc_gib": peak}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["roofline", "decode-check", "s1", "s2", "trl"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="override the recipe's cap (0 = the recipe's)")
    ap.add_argument("-S", "--set", action="append", default=[], help="params override, e.g. runtime.logprob_chunk=512")
    ap.add_argument("--layers", type=int, default=0, help="fewer decoder layers (smoke tests only)")
    ap.add_argument("--trl-cache", default="", help="TRL generation cache_implementation ('' = dynamic, or static)")
    ap.add_argument("--trl-fp32", dest="trl_bf16", action="store_false", help="TRL student in fp32 (default: bf16)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of the last step")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the logic (tiny shapes only)")
    ap.add_argument("--hidden", type=int, default=0, help="smaller hidden size (smoke tests only)")
    ap.add_argument("--arch", default="", help="another architecture at the shape, e.g. llama (no q/k/v biases)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    args.shape_kw = {"num_hidden_layers": args.layers} if args.layers else {}
    if args.arch:
        args.shape_kw.update(model_type=args.arch, attention_bias=False)
    if args.hidden:
        args.shape_kw.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=args.hidden // 4)
    t0 = time.perf_counter()
    if args.what == "roofline":
        res = roofline(args)
    elif args.what == "decode-check":
        res = decode_check(args)
    elif args.what == "s1":
        res = run_opd(args, recipe="s1.yaml", shape="qwen2-1.5b", prompt_len=(180, 260), solution_len=(0, 0))
    elif args.what == "s2":
        res = run_opd(args, recipe="s2.yaml", shape="qwen3-1.7b", prompt_len=(80, 250), solution_len=(200, 600))
    else:
        res = run_trl(args)
    res["wall_s"] = time.perf_counter() - t0
    res["peak_alloc_gib_max"] = max([s.get("peak_alloc_gib", 0) for s in res.get("steps", [])]
                                    + [res.get("peak_alloc_gib", 0)])
    text = json.dumps(res, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.what == "roofline" else json.dumps({k: v for k, v in res.items() if k != "steps"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

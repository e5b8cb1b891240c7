"""The decoder's GEMV launch settings measured where they run: the static decoder (batch 8, S1's lane pair, 1,024
new tokens at 1.0 / 1.0, no EOS) with one projection's configuration changed at a time, then the best of each
together. Among the settings: PRE, the blocks of weights a program loads before the kernel before it has finished
(``decode_triton.gemv_kernel`` under programmatic dependent launch), and the warps (the register budget PRE needs).

    python3 bench/gemv_pre_bench.py --root /dev/shm/lane --out OUT [--budget-s 300] [--tokens 1024]
    python3 bench/gemv_pre_bench.py --write-kit DIR --best OUT/gemv_best.json   # DIR/opdkit: this kit with them

Each configuration runs in a decoder of its own (its CUDA graphs captured with it); the rate is the median of
``--runs`` replayed generations after a first one (Triton's compile and the captures). Every row says whether
its samples (ids and recorded log-probs) are the default's bit for bit: a configuration changes only the time.
Rows go to OUT/gemv_pre.jsonl as they come; OUT/gemv_best.json holds the configuration taken per projection
(faster than the default by more than --min-gain in both of its measurements)."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (outputs, inputs) of each projection at the 1.5B shape, as ``gemv_config`` is asked (gate/up: N = one half)
SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (8960, 1536), "down": (1536, 8960)}
# (BLOCK_N, BLOCK_K, SPLIT, warps, stages, PRE) tried per projection, the default's blocks first
CANDIDATES = {
    "qkv": [(16, 256, 1, 8, 4, 1), (16, 256, 1, 4, 4, 2), (16, 256, 1, 8, 4, 2), (16, 256, 1, 8, 4, 3),
            (16, 256, 1, 8, 4, 6)],
    "o": [(16, 256, 1, 8, 4, 1), (16, 256, 1, 4, 4, 2), (16, 256, 1, 8, 4, 2), (16, 256, 1, 8, 4, 3),
          (16, 256, 1, 8, 4, 6)],
    "gate_up": [(32, 64, 1, 8, 4, 1), (32, 64, 1, 4, 4, 2), (32, 64, 1, 8, 4, 2), (32, 64, 1, 8, 4, 4),
                (32, 64, 1, 4, 4, 3)],
    "down": [(64, 256, 4, 8, 4, 1), (64, 256, 4, 8, 4, 2), (32, 256, 8, 4, 4, 1), (32, 256, 8, 4, 4, 2),
             (32, 256, 4, 4, 4, 2),
             # 5 splits of 1,792 inputs (the rule's splits are powers of 2): 120 programs, 91% of an H200's SMs; other
             # partial sums, so other bits: reported, not taken (a stated change of the samples, as the 8 splits)
             (64, 256, 5, 4, 4, 1), (32, 256, 5, 4, 4, 1)],
}


def write_kit(dest: Path, best: dict) -> None:
    """DIR/opdkit: a copy of this kit whose ``gemv_config`` returns ``best``'s configurations (others: the rule)."""
    shutil.rmtree(dest / "opdkit", ignore_errors=True)
    shutil.copytree(ROOT / "opdkit", dest / "opdkit", ignore=shutil.ignore_patterns("__pycache__"))
    table = {tuple(SHAPES[k]): tuple(v) for k, v in best.items()}
    with (dest / "opdkit" / "engines" / "decode_kernels.py").open("a") as f:
        f.write(f"\n\n_MEASURED = {table!r}\n_RULE = gemv_config\n\n\n"
                "def gemv_config(N, K, sms=132):  # bench/gemv_pre_bench.py --write-kit\n"
                "    return _MEASURED.get((N, K)) or _RULE(N, K, sms)\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/lane")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--min-gain", type=float, default=0.003, help="a projection's setting is taken above this gain")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no GEMV kernels there)")
    ap.add_argument("--write-kit", default="")
    ap.add_argument("--best", default="")
    ap.add_argument("--only", default="", help="the projections to vary (comma-separated among qkv,o,gate_up,down)")
    args = ap.parse_args(argv)
    if args.write_kit:
        write_kit(Path(args.write_kit), json.loads(Path(args.best).read_text()))
        return 0

    import torch
    from transformers import AutoModelForCausalLM

    from opdkit import opd
    from opdkit.engines import decode_kernels as dk
    from opdkit.engines.base import left_pad
    from opdkit.engines.static import StaticDecoder
    from opdkit.models import load_tokenizer

    sys.path.insert(0, str(ROOT / "bench"))
    from s1_speed import G, bounds, copy_bandwidth, lane_prompts

    t_start = time.perf_counter()
    out, root = Path(args.out), Path(args.root)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(root / "s1" / "student")
    model = AutoModelForCausalLM.from_pretrained(str(root / "s1" / "student"), dtype=torch.bfloat16)
    model = model.to(args.device).eval()
    rows = [p for p in lane_prompts(root, tok, 2) for _ in range(G)]
    ids, mask = left_pad(rows, tok.pad_token_id, args.device)
    seeds = opd.step_seeds(0, 0, len(rows))
    bound = bounds(model.config, copy_bandwidth(args.device), len(rows), ids.shape[1] + args.tokens / 2)
    rule = dk.gemv_config

    def synchronize() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    def rate(table: dict) -> tuple[float, str, list]:
        dk.gemv_config = lambda N, K, sms=132: table.get((N, K)) or rule(N, K, sms)
        try:
            dec = StaticDecoder(model, n_vocab=len(tok))
            walls, got = [], None
            for i in range(1 + args.runs):
                synchronize()
                t0 = time.perf_counter()
                got = dec.generate(ids, mask, seeds, max_new_tokens=args.tokens, temperature=1.0, top_p=1.0,
                                   eos_ids=[-1])
                synchronize()
                if i:
                    walls.append(time.perf_counter() - t0)
            steps = dec.stats["decode_steps"]
            digest = hashlib.sha256(got[0].cpu().numpy().tobytes() + got[1].cpu().numpy().tobytes()).hexdigest()[:16]
            del dec
            return steps / statistics.median(walls), digest, [round(steps / w, 1) for w in walls]
        finally:
            dk.gemv_config = rule
            if args.device == "cuda":
                torch.cuda.empty_cache()

    def emit(row: dict) -> None:
        with (out / "gemv_pre.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    base_rate, base_digest, base_runs = rate({})
    emit({"what": "default", "steps_per_s": round(base_rate, 1), "runs": base_runs, "samples_sha256": base_digest,
          "of_bound": round(base_rate / bound["bound_weights_steps_per_s"], 4), **bound,
          "configs": {k: rule(*v) for k, v in SHAPES.items()}})
    gains: dict[str, list] = {k: [] for k in SHAPES}
    only = set(args.only.split(",")) if args.only else set(CANDIDATES)
    for name, configs in CANDIDATES.items():
        if name not in only:
            continue
        for cfg in configs:
            if time.perf_counter() - t_start > args.budget_s:
                emit({"what": "stopped: budget", "at": [name, cfg]})
                break
            try:
                r, digest, runs = rate({SHAPES[name]: cfg})
            except Exception as e:  # a configuration that does not compile or launch here: reported, the next goes on
                emit({"what": name, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            emit({"what": name, "config": cfg, "steps_per_s": round(r, 1), "runs": runs,
                  "gain": round(r / base_rate - 1, 4), "same_bits": digest == base_digest})
            if digest == base_digest:
                gains[name].append((r / base_rate - 1, cfg))
    best = {}
    for name, found in gains.items():  # the best of each, measured again beside the default
        if not found or max(found)[0] <= args.min_gain or time.perf_counter() - t_start > args.budget_s:
            continue
        cfg = max(found)[1]
        again, digest, runs = rate({SHAPES[name]: cfg})
        base_again, _, base_runs = rate({})
        emit({"what": f"{name} again", "config": cfg, "steps_per_s": round(again, 1), "default": round(base_again, 1),
              "gain": round(again / base_again - 1, 4), "same_bits": digest == base_digest})
        if again / base_again - 1 > args.min_gain and digest == base_digest:
            best[name] = list(cfg)
    (out / "gemv_best.json").write_text(json.dumps(best))
    if best:
        table = {SHAPES[k]: tuple(v) for k, v in best.items()}
        for label, tb in (("best together", table), ("default again", {}), ("best together again", table)):
            r, digest, runs = rate(tb)
            emit({"what": label, "configs": best if tb else {}, "steps_per_s": round(r, 1), "runs": runs,
                  "of_bound": round(r / bound["bound_weights_steps_per_s"], 4), "same_bits": digest == base_digest})
    print(f"done in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

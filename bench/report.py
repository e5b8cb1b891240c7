"""Markdown tables from ``opd_bench.py`` JSON results:

    python bench/report.py roofline=r.json s1=s1.json trl=trl_7168.json s2=s2.json
        s1_short=s1_512.json trl_short=trl_512.json

(``trl`` goes beside ``s1``, ``trl_short`` beside ``s1_short``).

Step figures are the mean over the measured steps after the first (the first pays for CUDA-graph
capture, cuBLAS and allocator warm-up); with one step only, that step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _steady(steps: list[dict]) -> list[dict]:
    return steps[1:] if len(steps) > 1 else steps


def _mean(steps: list[dict], key: str):
    vals = [s[key] for s in steps if s.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def _s1_table(s1: dict, trl: dict | None, bw: float | None) -> list[str]:
    out = []
    st, f = _steady(s1["steps"]), s1["facts"]
    cap = s1["config"]["max_new_tokens"]
    bound = bw / f["decode_read_bytes_bf16"] if bw else None
    cols = [("opdkit", st)]
    if trl:
        cols.append(("TRL " + trl["trl"], _steady(trl["steps"])))
    head = f"| S1 shape (Qwen2-1.5B, 2 prompts x 4 samples, {cap:,} new tokens) | " + " | ".join(c for c, _ in cols)
    head += " | TRL / opdkit |" if trl else " |"
    out += [head, "|" + "---|" * (len(cols) + 1 + (1 if trl else 0))]

    def row(label, key, fmt="{:.2f}", ratio=False):
        vals = [_mean(s, key) for _, s in cols]
        line = f"| {label} | " + " | ".join(_f(v, fmt) for v in vals)
        if trl:
            line += " | " + (_f(vals[1] / vals[0], "{:.1f}x") if ratio and vals[0] and vals[1] else "")
        return line + " |"

    for _, s in cols:
        for x in s:
            x["score_update_s"] = x.get("score_s", 0.0) + x["update_s"]
    out += [row("step, s", "step_s", ratio=True), row("rollout (sampling), s", "rollout_s", ratio=True),
            row("teacher scoring, s", "score_s"), row("update (loss, backward, AdamW), s", "update_s"),
            row("teacher scoring + update, s", "score_update_s", ratio=True),
            row("decode steps/s (batch 8)", "decode_steps_per_s", "{:.0f}"),
            row("completion tokens per step", "tokens", "{:.0f}"),
            row("training tokens/s (update phase, prompt + completion)", "train_tokens_per_s", "{:.0f}"),
            row("update MFU (fwd+bwd FLOPs / 989 TFLOP/s)", "update_mfu", "{:.1%}"),
            row("teacher-scoring MFU", "score_mfu", "{:.1%}"),
            row("peak GPU memory allocated, GiB", "peak_alloc_gib")]
    if bound:
        out += ["", f"Decode bound: a step reads {f['decode_read_bytes_bf16'] / 1e9:.2f} GB of bf16 weights "
                    f"(decoder + LM head) -> {bound:.0f} steps/s at the measured copy bandwidth; opdkit reaches "
                    f"{_mean(st, 'decode_steps_per_s') / bound:.0%} of it (KV-cache reads, sampling and prefill "
                    "included)."]
    out += [f"Truncated share: {_mean(st, 'truncated_frac'):.0%} (random-init models never emit EOS: every sample "
            f"runs to the {cap:,}-token cap)."]
    return out


def report(results: dict[str, dict]) -> str:
    r = results.get("roofline", {})
    out = []
    bw = r.get("copy_bw_Bps")
    if r:
        out += [f"Device: {r['device']}, torch {r['torch']}, transformers {r['transformers']}. Measured ceilings: "
                f"device copy {bw / 1e12:.2f} TB/s (read + write), "
                f"bf16 8192³ matmul {r['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s; "
                f"a kernel launch {r.get('eager_launch_us', 0):.1f} µs eager, "
                f"{r.get('graph_node_us', 0):.2f} µs per node in a CUDA graph.", ""]
    for key, other in (("s1", "trl"), ("s1_short", "trl_short")):
        if key in results:
            out += _s1_table(results[key], results.get(other) if other else None, bw) + [""]
    s2 = results.get("s2")
    if s2:
        st = s2["steps"]
        out += ["", f"| S2 preset (Qwen3-1.7B shape, LoRA r=64, {s2['config']['P']} prompts x {s2['config']['G']}, "
                    f"{s2['config']['max_new_tokens']} new tokens, JSD entry-clip) | step 1 | " +
                " | ".join(f"step {s['step']}" for s in st[1:]) + " |", "|" + "---|" * (len(st) + 1)]
        for label, key, fmt in [("step, s", "step_s", "{:.2f}"), ("rollout, s", "rollout_s", "{:.2f}"),
                                ("teacher scoring, s", "score_s", "{:.2f}"), ("update, s", "update_s", "{:.2f}"),
                                ("decode steps/s", "decode_steps_per_s", "{:.0f}"),
                                ("peak memory allocated, GiB", "peak_alloc_gib", "{:.1f}")]:
            out.append(f"| {label} | " + " | ".join(_f(s.get(key), fmt) for s in st) + " |")
        out.append(f"Trainable (LoRA) parameters: {s2['trainable_params']:,} of {s2['facts']['n_params']:,}.")
    return "\n".join(out)


def main(argv=None) -> int:
    results = {}
    for arg in argv if argv is not None else sys.argv[1:]:
        key, _, p = arg.partition("=")
        if Path(p).is_file():
            results[key] = json.loads(Path(p).read_text())
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

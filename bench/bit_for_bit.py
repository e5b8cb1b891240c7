"""Bit-for-bit check of a refactor: a few short CPU trainings on the embedded default, fingerprinted.

Runs (3 steps each, 4 prompts x 2 samples, 40 new tokens, one thread): k1, rkl, jsd at
loss.jsd_beta 0.6 and 0.95, k1 with the reward (loss.reward_weight=0.3), k1 with one-step-off
rollouts (rollout.overlap=1), topk_fkl and sft (the top-K and control branches of the step). Each
run is a fresh ``python -m opdkit train`` of the tree this script sits in. The fingerprint: every
train.jsonl row with its timing / clock keys removed, and the sha256 of every tensor of every
checkpoint (safetensors, bytes as stored).

    python bench/bit_for_bit.py --out /tmp/bfb_before.json          # on the untouched tree
    python bench/bit_for_bit.py --out /tmp/bfb_after.json            # after the change
    python bench/bit_for_bit.py --compare /tmp/bfb_before.json /tmp/bfb_after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ("rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=40",
        "budget.max_steps=3", "budget.max_wall_time_s=0", "optim.schedule=cosine", "optim.warmup_steps=1",
        "publish.every_steps=0", "runtime.threads=1")
RUNS = {
    "k1": ("loss.name=k1",),
    "rkl": ("loss.name=rkl",),
    "jsd_0.6": ("loss.name=jsd", "loss.jsd_beta=0.6"),
    "jsd_0.95": ("loss.name=jsd", "loss.jsd_beta=0.95"),
    "k1_reward": ("loss.name=k1", "loss.reward_weight=0.3"),
    "k1_overlap": ("loss.name=k1", "rollout.overlap=1"),
    "topk_fkl": ("loss.name=topk_fkl",),
    "sft": ("loss.name=sft",),
}
# keys that measure time or the machine, not the computation
CLOCK_WORDS = ("time", "_s", "per_s", "clock", "elapsed", "wall", "seconds", "rss", "memory", "mem_")


def _is_clock(key: str) -> bool:
    k = key.lower()
    return k.endswith("_s") or any(w in k for w in CLOCK_WORDS if w != "_s")


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if not _is_clock(k)}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def fingerprint(out: Path) -> dict:
    from safetensors import safe_open

    rows = [_strip(json.loads(line)) for line in (out / "metrics" / "train.jsonl").read_text().splitlines()]
    tensors = {}
    for f in sorted((out / "checkpoints").rglob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(st.keys()):
                t = st.get_tensor(name).contiguous()
                digest = hashlib.sha256(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()).hexdigest()
                tensors[f"{f.relative_to(out)}:{name}"] = digest
    return {"rows": rows, "tensors": tensors}


def run_all(names) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = {}
    for name in names:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "run"
            cmd = [sys.executable, "-m", "opdkit", "train", "--out", str(out), "-p", "none", "--quiet"]
            for kv in (*TINY, *RUNS[name]):
                cmd += ["-S", kv]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            result[name] = fingerprint(out)
            print(f"{name}: {len(result[name]['rows'])} rows, {len(result[name]['tensors'])} tensors, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
    return result


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'after' if k not in a else 'before'}")
            else:
                out += _diff(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    diffs = _diff(a, b)
    for d in diffs[:50]:
        print(d)
    if diffs:
        print(f"DIFFERENT: {len(diffs)} values differ ({len(a)} runs before, {len(b)} after)")
        return 1
    n_rows = sum(len(r["rows"]) for r in a.values())
    n_t = sum(len(r["tensors"]) for r in a.values())
    print(f"IDENTICAL: {len(a)} runs, {n_rows} train.jsonl rows, {n_t} checkpoint tensors bit for bit")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the fingerprint JSON here")
    p.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args()
    if args.compare:
        return compare(Path(args.compare[0]), Path(args.compare[1]))
    result = run_all(args.runs)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

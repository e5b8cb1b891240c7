"""Collectives per training step at S1's structure, counted on 2 gloo CPU ranks.

    python bench/collective_counts.py [--layers 28] [--chunks 28] [--rows-per-rank 4] [--out DIR]
    PYTHONPATH=/path/to/an/older/checkout python bench/collective_counts.py --same-length   # opdkit before #22

What a step's collectives are depends on the structure, not the sizes: the number of decoder
layers (S1: 28), of position chunks (S1: 7,168 tokens / logprob_chunk 256 = 28), of rows per rank
(2 prompts x 4 samples over 2 ranks: 4) and micro-batches (S1: 1), unpadded rows (S1: on), full
fine-tune, an untied head and a replicated teacher. So this builds a tiny random Llama pair with
that many layers and an untied head (hidden 16, the embedded tokenizer), and runs one update
(``tests/collective_worker.py``, as ``tests/test_collectives.py`` does) on rows whose longest
completion makes ``--chunks`` chunks of 2 positions on rank 0 and one chunk fewer on rank 1
(``--same-length``: as many on both, for code that would hang otherwise). Prints each rank's
counts (``c10d::`` ops in the profiler: ``_allgather_base_`` / ``_reduce_scatter_base_`` are FSDP2's)
for the whole update and for ``micro_losses``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_pair(root: Path, layers: int) -> tuple[Path, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.append(str(ROOT))
    from opdkit.embedded import asset

    src = Path(asset("student"))
    tok_files = [f for f in src.iterdir() if f.name.startswith(("tokenizer", "special_tokens", "vocab"))]
    base = json.loads((src / "config.json").read_text())
    dirs = []
    for name, seed in (("student", 0), ("teacher", 1)):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=base["vocab_size"], hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                          tie_word_embeddings=False, pad_token_id=base["pad_token_id"],
                          bos_token_id=base["bos_token_id"], eos_token_id=base["eos_token_id"])
        d = root / name
        LlamaForCausalLM(cfg).save_pretrained(d)
        for f in tok_files:
            shutil.copy(f, d / f.name)
        dirs.append(d)
    return dirs[0], dirs[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--chunks", type=int, default=28)
    ap.add_argument("--rows-per-rank", type=int, default=4)
    ap.add_argument("--same-length", action="store_true")
    ap.add_argument("--padded", action="store_true", help="runtime.unpadded_rows=false")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="opdkit_counts_"))
    student, teacher = write_pair(out / "models", args.layers)
    T0 = 2 * args.chunks  # logprob_chunk 2: T0 / 2 chunks on rank 0
    T1 = T0 if args.same_length else T0 - 2
    r = args.rows_per_rank
    lengths = [T0, *range(T0 - 3, T0 - 3 - (r - 1), -1), T1, *range(5, 5 + r - 1)]
    case = {"overrides": [f"student.path={student}", f"teacher.path={teacher}", "rollout.prompts_per_step=2",
                          f"rollout.samples_per_prompt={r}", "runtime.logprob_chunk=2",
                          f"runtime.unpadded_rows={'false' if args.padded else 'true'}"], "lengths": lengths}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([p for p in (env.get("PYTHONPATH"), str(ROOT), str(ROOT / "tests")) if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "collective_worker.py"), str(out / "counts"), json.dumps({"s1": case})]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        sys.exit(proc.stderr[-4000:])
    for rank in (0, 1):
        got = json.loads((out / "counts" / "s1" / f"rank{rank}.json").read_text())
        print(json.dumps({"rank": rank, "layers": args.layers, "rows": r, "T": got["T"], "chunks": got["chunks"],
                          "step": got["step"], "micro_losses": got["micro_losses"]}))
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()

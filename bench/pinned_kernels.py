"""Does holding the CPU kernels to one instruction set change the embedded build's bits? The first
``--steps`` supervised steps of the rebuild's first phase (the teacher, the shipped config), each run in
a fresh interpreter: natively (whatever this CPU dispatches), and pinned at each ``--isa`` (opdkit's
``embedded.build.PINNED`` settings, set before torch is imported), twice each; prints the sha256 of
the weights after those steps and the capability torch reported.

    python bench/pinned_kernels.py [--steps 20] [--isa AVX2 AVX512] [--only ATEN_CPU_CAPABILITY=avx2 ...]

``--only KEY=VALUE``: one more run each with just that setting (the others native), to see which
library's dispatch changes the bits.

Pinned runs that agree with each other and differ from the native run show the settings took hold;
on a machine whose native set is the pinned one, native and pinned agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from opdkit.config import EmbeddedConfig
from opdkit.embedded import task
from opdkit.embedded.build import _arch_kwargs, sft_train, teacher_shape
from opdkit.embedded.tokenizer import build_tokenizer
e, steps = EmbeddedConfig(), int(sys.argv[1])
torch.manual_seed(e.seed); torch.set_num_threads(e.threads); torch.use_deterministic_algorithms(True)
rows, _ = task.make_splits(e.seed, e.n_train, e.n_eval, e.n_ops, e.n_ops)
tok = build_tokenizer()
torch.manual_seed(e.seed)
model = LlamaForCausalLM(LlamaConfig(**_arch_kwargs(teacher_shape(e), len(tok), tok)))
sft_train(model, tok, rows, [r["solution"] for r in rows], steps=steps, total=e.teacher_steps, start=0,
          batch_size=e.batch_size, lr=e.lr, warmup=e.warmup_steps, seed=e.seed, log=lambda s: None)
h = hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.state_dict().values()))
print(json.dumps({"sha256": h.hexdigest(), "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def run(steps: int, env: dict) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in env_keys()} | env | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(steps)], env=full, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def env_keys() -> tuple[str, ...]:
    sys.path.insert(0, str(ROOT))
    from opdkit.embedded.build import PINNED_KEYS

    return PINNED_KEYS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--isa", nargs="*", default=["AVX2", "AVX512"])
    ap.add_argument("--only", nargs="*", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from opdkit.embedded.build import PINNED

    rows = [("native", run(args.steps, {}))]
    for isa in args.isa:
        for i in (1, 2):
            rows.append((f"pinned {isa} #{i}", run(args.steps, PINNED[isa])))
    for setting in args.only:
        key, value = setting.split("=", 1)
        rows.append((f"only {setting}", run(args.steps, {key: value})))
    for name, r in rows:
        print(f"{name:34s} torch capability {r['capability']:7s} sha256 {r['sha256'][:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

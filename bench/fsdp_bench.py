"""`opdkit train` at the S1 shape on 1 GPU and on N GPUs (torchrun, FSDP2), same global batch.

    python bench/fsdp_bench.py --out DIR [--steps 3] [--nproc 2] [--max-new-tokens N]
    python bench/fsdp_bench.py train --out DIR --name A --nproc 1 --rollout-batch-size 4 --steps 1
    python bench/fsdp_bench.py compare --out DIR --runs A B C    # updates of B, C against A's
    python bench/fsdp_bench.py --out DIR --device cpu --layers 2 --hidden 64 --vocab 512   # dry run (gloo)

1. Writes a random-init student and teacher at the Qwen2-1.5B shape as HF directories, a stand-in
   word-level tokenizer and a jsonl of random-token prompts. The directories use the Llama
   architecture at that shape (no q/k/v biases): transformers 5's AutoTokenizer loads any tokenizer
   in a ``qwen2`` directory as Qwen2Tokenizer, which cannot read the stand-in vocabulary.
2. Runs the real training loop: ``python -m opdkit train -r recipes/s1.yaml`` on one GPU, then
   ``torchrun --nproc-per-node N -m opdkit train`` with the same recipe, seed and steps.
   Rollout and scoring shapes are matched so the two runs can agree: each rank decodes its
   P*G/N rows (``rollout.batch_size`` = P*G/N on one GPU as well) and ``runtime.unpadded_rows``
   scores and trains every row alone in both runs. ``--ref-batch-size 0`` instead decodes all
   rows at once on one GPU (the fastest single-GPU setting, for step time alone).
3. Compares the published final weights: per tensor, the update d = w_final - w_initial of each
   run; reports the relative L2 difference |d_N - d_1| / |d_1|, their cosine and max |w_N - w_1|,
   and the per-step loss / KL / step seconds / peak memory from each run's metrics file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from opd_bench import EOS_ID, random_prompts, stand_in_tokenizer  # noqa: E402

from opdkit.models import random_model, shape_config  # noqa: E402


def make_inputs(root: Path, args) -> dict:
    """Student/teacher HF directories (bf16 safetensors) and a jsonl of prompts under ``root``."""
    V = args.vocab
    eos = EOS_ID if V > EOS_ID else V - 1
    kw = dict(model_type="llama", vocab_size=V, eos_token_id=eos, pad_token_id=eos, bos_token_id=None,
              attention_bias=False, mlp_bias=False, head_dim=128)
    if args.layers:
        kw["num_hidden_layers"] = args.layers
    if args.hidden:
        kw.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=args.hidden // 4)
    cfg = shape_config("qwen2-1.5b", **kw)
    tok = stand_in_tokenizer(V, eos_id=eos)
    dev = "cuda" if args.device == "cuda" else "cpu"
    paths = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        p = root / name
        if not (p / "config.json").exists():
            m = random_model(cfg, dev, torch.bfloat16, seed=seed)
            m.save_pretrained(p)
            tok.save_pretrained(p)
            del m
        paths[name] = p
    data = root / "prompts.jsonl"
    if not data.exists():
        lo, hi = (180, 260) if not args.hidden else (20, 40)
        rows = [{"prompt": " ".join(f"t{i % (V - 1)}" for i in p), "answer": "0"}
                for p in random_prompts(64, lo, hi, seed=0)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["data"] = data
    return paths


def train_cmd(nproc: int, out: Path, paths: dict, args, batch_size: int) -> list[str]:
    launcher = ([sys.executable, "-m", "opdkit"] if nproc == 1 else
                ["torchrun", "--standalone", "--nproc-per-node", str(nproc), "-m", "opdkit"])
    sets = [f"student.path={paths['student']}", f"teacher.path={paths['teacher']}", f"data.train={paths['data']}",
            f"data.eval={paths['data']}", "data.chat_template=false", f"budget.max_steps={args.steps}",
            "budget.max_wall_time_s=0", f"publish.every_steps={args.steps}", "publish.keep=1",
            f"rollout.batch_size={batch_size}", "runtime.unpadded_rows=true", *args.set]
    if args.max_new_tokens:
        sets.append(f"rollout.max_new_tokens={args.max_new_tokens}")
    if args.device == "cpu":
        sets += ["runtime.device=cpu", "runtime.threads=1"]
    return [*launcher, "train", "--out", str(out), "-p", "none", "-r", str(ROOT / "recipes" / "s1.yaml"), "--quiet",
            *(x for s in sets for x in ("-S", s))]


def run(cmd: list[str], log: Path) -> float:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    t0 = time.perf_counter()
    with log.open("w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"fsdp_bench: {' '.join(cmd[:6])} ... exited {r.returncode} (log {log})")
    return wall


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"fsdp_bench: no safetensors in {ckpt}")
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def compare(init: Path, a: Path, b: Path) -> dict:
    """Updates of run a and run b from the same initial weights (fp32 arithmetic, on the GPU if any)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w0, wa, wb = load_weights(init), load_weights(a), load_weights(b)
    if set(wa) != set(wb):
        raise SystemExit(f"fsdp_bench: checkpoints differ in tensor names: {sorted(set(wa) ^ set(wb))[:5]}")
    dot = na = nb = ndiff = 0.0
    max_abs_w = max_abs_d = 0.0
    worst = ("", 0.0)
    for k in sorted(wa):
        x0 = w0[k].to(dev, torch.float32)
        da, db = wa[k].to(dev, torch.float32) - x0, wb[k].to(dev, torch.float32) - x0
        dot += float((da * db).sum())
        na += float((da * da).sum())
        nb += float((db * db).sum())
        e = float(((da - db) ** 2).sum())
        ndiff += e
        max_abs_w = max(max_abs_w, float((da - db).abs().max()))
        max_abs_d = max(max_abs_d, float(da.abs().max()))
        rel = (e / max(float((da * da).sum()), 1e-30)) ** 0.5
        if rel > worst[1]:
            worst = (k, rel)
    return {"tensors": len(wa), "update_rel_l2_diff": (ndiff / na) ** 0.5 if na else None,
            "update_cosine": dot / (na * nb) ** 0.5 if na and nb else None, "update_norm_1": na ** 0.5,
            "update_norm_n": nb ** 0.5, "max_abs_weight_diff": max_abs_w, "max_abs_update": max_abs_d,
            "worst_tensor": worst[0], "worst_tensor_rel_l2_diff": worst[1], "dtype": str(next(iter(wa.values())).dtype)}


def metrics(out: Path) -> list[dict]:
    keep = ("step", "loss", "kl", "grad_norm", "tokens", "time_rollout_s", "time_score_s", "time_update_s",
            "peak_mem_gb")
    rows = [json.loads(line) for line in (out / "metrics" / "train.jsonl").read_text().splitlines() if line.strip()]
    return [{k: r.get(k) for k in keep} | {"step_s": r["time_rollout_s"] + r["time_score_s"] + r["time_update_s"]}
            for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=["all", "prepare", "train", "compare"],
                    help="all: prepare, 1-GPU run, N-GPU run, compare; or one phase (train: --name, --nproc)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="", help="train: the run's folder under --out")
    ap.add_argument("--runs", nargs="*", default=[], help="compare: reference run, then runs to compare with it")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0 = the recipe's 7,168")
    ap.add_argument("--rollout-batch-size", type=int, default=-1,
                    help="rollout.batch_size (-1 = the per-rank rows of a --nproc run: 8 // nproc)")
    ap.add_argument("--ref-batch-size", type=int, default=-1, help="all: rollout.batch_size of the 1-GPU run")
    ap.add_argument("-S", "--set", action="append", default=[], help="extra params override for the runs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args(argv)
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    paths = make_inputs(root, args)
    per_rank = 2 * 4 // args.nproc  # S1: 2 prompts x 4 samples

    def train(name: str, nproc: int, batch_size: int) -> dict:
        wall = run(train_cmd(nproc, root / name, paths, args, batch_size), root / f"{name}.log")
        return {"name": name, "nproc": nproc, "rollout_batch_size": batch_size, "wall_s": wall,
                "steps": metrics(root / name)}

    if args.what == "prepare":
        res = {"what": "prepare", "setup_s": time.perf_counter() - t0}
    elif args.what == "train":
        bs = per_rank if args.rollout_batch_size < 0 else args.rollout_batch_size
        res = train(args.name or f"run{args.nproc}", args.nproc, bs)
    elif args.what == "compare":
        ref, *others = args.runs
        res = {"what": "compare", "reference": ref, "runs": {}}
        for name in [ref, *others]:
            res["runs"][name] = metrics(root / name)
        steps = min(len(res["runs"][n]) for n in [ref, *others])
        ck = f"checkpoints/checkpoint-{steps}"
        res["weights_at_step"] = steps
        res["weights"] = {o: compare(paths["student"], root / ref / ck, root / o / ck) for o in others}
    else:
        single, multi = "single", f"fsdp{args.nproc}"
        ref_bs = per_rank if args.ref_batch_size < 0 else args.ref_batch_size
        res = {"what": "fsdp", "single": train(single, 1, ref_bs), "multi": train(multi, args.nproc, per_rank)}
        ck = f"checkpoints/checkpoint-{args.steps}"
        res["weights"] = compare(paths["student"], root / single / ck, root / multi / ck)
    res["wall_s"] = time.perf_counter() - t0
    text = json.dumps(res, indent=1)
    (root / f"{args.what}{'_' + args.name if args.name else ''}.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU lane's python parts: what a user runs, on Qwen2.5 / Qwen3-shaped random-init models with
the real Qwen2.5 tokenizer (bench/gpu_lane.sh calls these; each writes its result the moment it has one).

    python bench/real_lane.py prepare --root R --assets .lane [--tiny] [--pairs s1 s2]
    python bench/real_lane.py train --root R --name NAME --recipe s1|s2 --steps N [-S key=value ...] --out OUT
    python bench/real_lane.py vllm-load --ckpt DIR --out OUT
    python bench/real_lane.py report --out OUT

``prepare`` writes, under R: ``s1/student`` (Qwen2-1.5B shape, 151,936 embedding rows),
``s1/teacher`` (the same shape with 152,064 rows: Qwen2.5-7B's), ``s2/student`` (Qwen3-1.7B shape,
151,936 rows, tied head; S2's teacher is the student itself, privileged), random init in bf16
(heads of the init's std: near-uniform next-token distributions, so samples run to the token cap),
each with the real Qwen2.5 tokenizer (151,665 ids) from ``.lane/`` (``bench/lane_assets.sh``) and
the fixture's generation configs (sampling defaults 0.6 / 0.95, the student's
repetition_penalty 1.05, which the sampler must not inherit); and ``s1/train.jsonl`` (DAPO-shaped
chat prompts) and ``s2/train.jsonl`` (MATH-500-shaped problem / solution rows), the fixture's.
``--tiny`` (a CPU dry run): 2 layers of hidden 64, the same vocabularies.

``train`` runs ``python -m opdkit train -p none -r recipes/<recipe>.yaml`` on them into
``R/runs/NAME`` (``budget.max_steps`` = N, published at N; a second call with a larger N resumes
it) and appends one JSON line to ``OUT/runs.jsonl``: exit status, wall seconds, and per step the
rollout / scoring / update seconds, peak GPU memory, tokens, loss, kl, plus the first batch's
alignment check (max / mean |recomputed - sampling-time log-prob|, the weight-0 share: sampled tokens
outside the recomputed top-p nucleus). ``vllm-load`` loads a published checkpoint in vLLM as it is (its own tokenizer)
and generates a few tokens (``OUT/runs.jsonl`` too). ``report`` writes ``OUT/lane.md``, the table.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
KEEP = ("step", "elapsed_s", "time_rollout_s", "time_score_s", "time_update_s", "peak_mem_gb", "tokens",
        "truncated_frac", "loss", "kl", "grad_norm", "ratio_max", "rollout_lag", "unchecked_layers_max",
        "matmul_layers_max")


def _append(out: Path, row: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "runs.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------- prepare


def _tokenizer_files(assets: Path, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_bytes(lzma.decompress((assets / "tokenizer.json.xz").read_bytes()))
    (d / "tokenizer_config.json").write_bytes((assets / "tokenizer_config.json").read_bytes())


def _model(shape: str, rows: int, role: str, d: Path, assets: Path, device: str, tiny: bool, seed: int) -> None:
    import torch

    from opdkit.fixture import ENDOFTEXT, IM_END, SAMPLING
    from opdkit.models import random_model, shape_config

    if (d / "config.json").is_file():
        return
    cfg = shape_config(shape, vocab_size=rows, bos_token_id=ENDOFTEXT, eos_token_id=IM_END, pad_token_id=None,
                       **(TINY if tiny else {}))
    model = random_model(cfg, device, torch.bfloat16, seed=seed)
    g = model.generation_config
    g.bos_token_id, g.eos_token_id, g.pad_token_id = ENDOFTEXT, [IM_END, ENDOFTEXT], ENDOFTEXT
    for k, v in SAMPLING[role].items():
        setattr(g, k, v)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(str(d))
    _tokenizer_files(assets, d)
    del model


def prepare(args) -> dict:
    import torch

    from opdkit.fixture import problems

    t0 = time.perf_counter()
    root, assets = Path(args.root), Path(args.assets)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    _model("qwen2-1.5b", 151936, "student", root / "s1" / "student", assets, device, args.tiny, 0)
    _model("qwen2-1.5b", 152064, "teacher", root / "s1" / "teacher", assets, device, args.tiny, 1)
    if "s2" in args.pairs:
        _model("qwen3-1.7b", 151936, "student", root / "s2" / "student", assets, device, args.tiny, 2)
    for name, rows in (("s1", problems.train_rows()), ("s2", problems.eval_rows())):
        if name in args.pairs:
            (root / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = {"what": "prepare", "root": str(root), "tiny": args.tiny, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(res))
    return res


# ----------------------------------------------------------------------------- train


def train_cmd(args) -> list[str]:
    pair = Path(args.root) / args.recipe
    sets = [f"student.path={pair / 'student'}", f"data.train={pair / 'train.jsonl'}",
            f"data.eval={pair / 'train.jsonl'}", f"budget.max_steps={args.steps}", "budget.max_wall_time_s=0",
            f"publish.every_steps={args.steps}", "publish.keep=1"]
    if args.recipe == "s1":
        sets.append(f"teacher.path={pair / 'teacher'}")
    sets += args.set
    if args.tiny:  # last: the CPU dry run wins over the lane's engine and lengths
        sets += ["runtime.device=cpu", "runtime.threads=1", "rollout.max_new_tokens=6", "rollout.engine=hf",
                 "runtime.logprob_chunk=4", "rollout.prompts_per_step=2", "optim.micro_batch=0"]
    return [sys.executable, "-m", "opdkit", "train", "--out", str(Path(args.root) / "runs" / args.name), "-p", "none",
            "-r", str(ROOT / "recipes" / f"{args.recipe}.yaml"), "--quiet", *(x for s in sets for x in ("-S", s))]


def run_waiting(cmd: list[str], **kw) -> int:
    """``subprocess.run(cmd).returncode``, except that a SIGTERM / SIGINT to this process waits for the trainer:
    it is passed on (the trainer saves and exits 128+N) and this returns its status. Without this, ``timeout``
    killed this wrapper at once and returned while the trainer was still saving, and gpu_lane.sh's ``rm -rf`` of
    the run directory then removed the save in flight (the lane's two lost saves: docs/end_of_run.md)."""
    import signal

    proc = subprocess.Popen(cmd, **kw)
    previous = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def train(args) -> dict:
    out_dir = Path(args.root) / "runs" / args.name
    log = Path(args.root) / f"{args.name}.log"
    kit = Path(args.kit).resolve() if args.kit else ROOT  # --kit: another copy of the kit (e.g. main's) runs it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(kit), os.environ.get("PYTHONPATH", "")])}
    cmd = train_cmd(args)
    t0 = time.perf_counter()
    with log.open("a") as f:
        rc = run_waiting(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=kit)
    rows = []
    metrics = out_dir / "metrics" / "train.jsonl"
    if metrics.is_file():
        rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    res = {"what": "train", "name": args.name, "recipe": args.recipe, "steps": args.steps, "rc": rc,
           "wall_s": round(time.perf_counter() - t0, 1), "overrides": args.set, "kit": str(kit),
           "checkpoints": sorted(p.name for p in (out_dir / "checkpoints").glob("checkpoint-*")),
           "rows": [{k: r.get(k) for k in KEEP} for r in rows]}
    aligned = [r["alignment"] for r in rows if r.get("alignment")]
    if aligned:  # the check of the latest start (a resume checks its own first batch)
        res["alignment"] = {k: v for k, v in aligned[-1].items() if "dlogp" in k or "outside" in k or "weight0" in k}
    text = log.read_text()
    took = [ln[-160:] for ln in text.splitlines() if " took " in ln and "second" in ln][-4:]  # vLLM's start-up lines
    res["log_tail"] = text[-1500:] if rc else "\n".join(took)
    _append(Path(args.out), res)
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
    return res


# ----------------------------------------------------------------------------- vLLM loads a published checkpoint


def vllm_load(args) -> dict:
    """The published checkpoint as a user would serve it: vLLM reads it from disk, tokenizer and all."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.perf_counter()
    res = {"what": "vllm_load", "ckpt": args.ckpt}
    try:
        import vllm
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.ckpt)
        llm = vllm.LLM(model=args.ckpt, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
                       max_model_len=512, max_num_seqs=2)
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is 7 * 8?"}], add_generation_prompt=True,
                                         tokenize=False)
        out = llm.generate([prompt], vllm.SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
        res.update(ok=len(out.token_ids) > 0, tokens=list(out.token_ids), text=out.text,
                   max_id_ok=max(out.token_ids) < len(tok))
    except Exception as e:  # reported, not hidden: the lane goes on
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:600]}")
    res["seconds"] = round(time.perf_counter() - t0, 1)
    _append(Path(args.out), res)
    print(json.dumps(res))
    return res


# ----------------------------------------------------------------------------- report


def _fmt(x, spec=".2f"):
    return "" if x is None else format(x, spec)


def report(args) -> str:
    out = Path(args.out)
    runs = ([json.loads(ln) for ln in (out / "runs.jsonl").read_text().splitlines()]
            if (out / "runs.jsonl").is_file() else [])
    lines = ["| run | engine, settings | rc | step | step s | rollout s | scoring s | update s | peak GiB | tokens | "
             "max / mean abs dlogp (outside) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    shown: dict[str, int] = {}  # a resumed run's line repeats its earlier steps: show each step once
    for r in runs:
        if r["what"] == "vllm_load":
            lines.append(f"| vLLM loads {Path(r['ckpt']).name} | | {'ok' if r.get('ok') else 'FAILED'} | | "
                         f"{_fmt(r.get('seconds'), '.1f')} | | | | | {len(r.get('tokens', []))} | "
                         f"{r.get('error', '')[:80]} |")
            continue
        if r["what"] != "train":
            continue
        a = r.get("alignment") or {}
        align = (f"{_fmt(a.get('recompute_max_abs_dlogp'), '.3g')} / {_fmt(a.get('recompute_mean_abs_dlogp'), '.3g')} "
                 f"({_fmt(a.get('recompute_weight0_share', a.get('recompute_outside_nucleus_frac')), '.2g')})"
                 if a else "")
        settings = ", ".join(o.split("=")[0].split(".")[-1] + "=" + o.split("=", 1)[1] for o in r["overrides"])
        new = [s for s in r["rows"] if s.get("step", 0) > shown.get(r["name"], 0)]
        shown[r["name"]] = max([shown.get(r["name"], 0)] + [s.get("step", 0) for s in new])
        for i, s in enumerate(new or [{}]):
            step_s = sum(s.get(k) or 0 for k in ("time_rollout_s", "time_score_s", "time_update_s")) if s else None
            lines.append(f"| {r['name']} | {settings} | {r['rc']} | {s.get('step', '')} | {_fmt(step_s, '.1f')} | "
                         f"{_fmt(s.get('time_rollout_s'))} | {_fmt(s.get('time_score_s'))} | "
                         f"{_fmt(s.get('time_update_s'))} | {_fmt(s.get('peak_mem_gb'), '.1f')} | "
                         f"{s.get('tokens', '')} | {align if i == 0 else ''} |")
    text = "\n".join(lines) + "\n"
    (out / "lane.md").write_text(text)
    print(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prepare", "train", "vllm-load", "report"])
    ap.add_argument("--root", default="/tmp/lane")
    ap.add_argument("--assets", default=str(ROOT / ".lane"))
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny shapes, the real vocabularies")
    ap.add_argument("--name", default="")
    ap.add_argument("--recipe", choices=["s1", "s2"], default="s1")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("-S", "--set", action="append", default=[], help="params override for the run")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--pairs", nargs="+", default=["s1", "s2"], help="prepare: which pairs to build")
    ap.add_argument("--kit", default="", help="train: run this copy of the kit (its directory holds opdkit/)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = ap.parse_args(argv)
    {"prepare": prepare, "train": train, "vllm-load": vllm_load, "report": report}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

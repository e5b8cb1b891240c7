"""Why the teacher-consistency study (bench/offline_study.py, docs/offline_opd.md) uses the sources it uses:

1. the embedded teacher's samples are the reference solutions: it samples the first ``--prompts`` training
   prompts at temperature 1 (the HF engine, seeds 0..n-1) and its completions are compared with the
   references token for token, and its NLL of the references measured;
2. a correct second teacher in another style cannot be learned by the embedded student: 40 SFT steps from the
   shipped student (as the study's SFT) on each rewritten copy of the training rows, then ``opdkit eval``:
   ``spaced`` (" 84 + 9 = 93."), ``swapped`` (additions' operands swapped: " 9+84=93."), ``chain``
   (" 84+9-73+25=93-73+25=20+25=45.").

    python bench/offline_study_probes.py --out runs/offline_study/probes --results bench/results/offline
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from opdkit import opd
from opdkit.config import load_config
from opdkit.data import read_table, write_rows
from opdkit.embedded import asset
from opdkit.embedded.task import parse_prompt
from opdkit.engines.hf import HFEngine
from opdkit.scoring import completion_hidden, token_logprobs, unwrap
from opdkit.setup import build_run, prepare_inputs
from opdkit.stages.jobs import Job, run_jobs


def _steps(prompt: str):
    p = parse_prompt(prompt)
    value, out = p.first, []
    for op, x in p.ops:
        new = value + x if op == "+" else value - x
        out.append((value, op, x, new))
        value = new
    return p, out, value


def spaced(prompt: str) -> str:
    _, steps, v = _steps(prompt)
    return "".join(f" {a} {op} {x} = {n}." for a, op, x, n in steps) + f" \\boxed{{{v}}}"


def swapped(prompt: str) -> str:
    _, steps, v = _steps(prompt)
    return "".join(f" {x}+{a}={n}." if op == "+" else f" {a}-{x}={n}." for a, op, x, n in steps) + f" \\boxed{{{v}}}"


def chain(prompt: str) -> str:
    p, steps, v = _steps(prompt)
    rest = [f"{op}{x}" for op, x in p.ops]
    parts = [str(p.first) + "".join(rest)] + [str(n) + "".join(rest[i + 1:]) for i, (_, _, _, n) in enumerate(steps)]
    return " " + "=".join(parts) + f". \\boxed{{{v}}}"


STYLES = {"spaced": spaced, "swapped": swapped, "chain": chain}


@torch.no_grad()
def teacher_vs_references(n: int) -> dict:
    """The teacher's temperature-1 samples of the first n training prompts against their references."""
    cfg = load_config(None, ["runtime.threads=1", "budget.max_steps=1", "budget.max_wall_time_s=0",
                             "optim.schedule=constant"])
    inputs = prepare_inputs(cfg)
    run = build_run(cfg, inputs, log=lambda s: None)
    tok, examples = run.tokenizer, inputs.examples[:n]
    prompts = run.prompts(examples)
    ro = HFEngine(run.teacher, tok).sample(prompts, samples_per_prompt=1, seeds=list(range(n)), temperature=1.0,
                                           top_p=1.0, max_new_tokens=64)
    same = sum(tok.decode(ro.completion_ids_B_T[b][ro.completion_mask_B_T[b].bool()], skip_special_tokens=True)
               == ex.solution for b, ex in enumerate(examples))
    ref = opd.reference_rollout(prompts, [tok(ex.solution, add_special_tokens=False).input_ids for ex in examples],
                                tok.pad_token_id, tok.eos_token_id, run.device)
    batch = opd.Batch(ref, ref.prompt_ids_B_Sp, ref.prompt_mask_B_Sp)
    _, head = unwrap(run.teacher)
    hidden = completion_hidden(run.teacher, opd.teacher_geometry(batch))
    logp = token_logprobs(head, hidden, ref.completion_ids_B_T, 2048)
    m = ref.completion_mask_B_T.bool()
    return {"prompts": n, "samples_equal_to_reference": same,
            "teacher_nll_of_references_per_token": float(-logp[m].mean()), "reference_tokens": int(m.sum())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/offline_study/probes")
    ap.add_argument("--results", default="bench/results/offline")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    out = Path(args.out)
    rows = read_table(asset("train"))
    jobs, evals = [], {}
    for name, write in STYLES.items():
        data = out / "data" / f"{name}.parquet"
        if not data.is_file():
            write_rows([r | {"solution": write(r["prompt"])} for r in rows], data)
        run, ev = out / "sft" / name, out / "eval" / f"{name}.json"
        ck = run / "checkpoints" / f"checkpoint-{args.sft_steps}"
        sets = ["runtime.threads=1", "tracking=none", "budget.max_wall_time_s=0", "loss.name=sft",
                "loss.sft_source=reference", f"data.train={data}", f"budget.max_steps={args.sft_steps}",
                "optim.warmup_steps=5", f"publish.every_steps={args.sft_steps}", "seed=0"]
        argv_t = ("train", "--out", str(run), "-p", args.params, "--quiet", *sum((["-S", s] for s in sets), []))
        jobs.append(Job(f"sft/{name}", argv_t, (str(data),), (str(run),), {"argv": list(argv_t)}, 1.0,
                        str(out / "logs" / f"sft-{name}.log")))
        evals[name] = (ck, ev)
    if run_jobs(jobs, out / "ledgers" / "sft.json", args.workers, 1, roots=[out / "sft"]) != 0:
        sys.exit("bench/offline_study_probes.py: an SFT run failed (logs under OUT/logs)")
    ejobs = []
    for name, (ck, ev) in evals.items():
        argv_e = ("eval", "--model", str(ck), "--out", str(ev), "-p", args.params, "--quiet", "-S", "runtime.threads=1",
                  "--tag", f"arm={name}")
        ejobs.append(Job(f"eval/{name}", argv_e, (str(ck),), (str(ev), str(ev.with_suffix(".jsonl"))),
                         {"argv": list(argv_e)}, 1.0, str(out / "logs" / f"eval-{name}.log")))
    if run_jobs(ejobs, out / "ledgers" / "eval.json", args.workers, 1, roots=[out / "eval"]) != 0:
        sys.exit("bench/offline_study_probes.py: an eval failed (logs under OUT/logs)")
    result = {"teacher_vs_references": teacher_vs_references(args.prompts),
              "styles": {name: {"example": STYLES[name](rows[0]["prompt"]), "sft_steps": args.sft_steps,
                                **{k: json.loads(ev.read_text())[k] for k in ("accuracy", "stderr")}}
                         for name, (_, ev) in evals.items()}}
    Path(args.results).mkdir(parents=True, exist_ok=True)
    (Path(args.results) / "probes.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

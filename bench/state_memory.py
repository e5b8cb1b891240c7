"""Peak host memory of saving the trainer state, on the CPU, at a shape of >= 500M parameters.

    python bench/state_memory.py [--layers 2] [--out /tmp/opdkit_state_memory]

Builds a random-init student at the S1 shape (``models.shape_config("qwen2-1.5b")``: vocabulary
151,936, hidden 1,536, untied head) with fewer layers, in fp32, and an AdamW whose state is filled
(one step with zero gradients at lr 0). Then it saves the trainer state into ``--out`` (removed
afterwards) with ``opdkit.persist.trainer_state.save`` and reports, as one JSON line: the parameters, the
tensor groups written (the weights and each Adam moment; the largest is the bound), the resident
memory before the save, the peak during it (Linux ``VmHWM``, reset just before the save through
``/proc/self/clear_refs``), and the increase over the largest group. Memory, not time: a busy
machine gives the same numbers. Needs about 3x the weights (7 GB at 2 layers) resident, plus what
the save adds, and as much disk. (The "before" row of docs/scaling_out.md: this script as of commit
c567c61, which fell back to ``opdkit.train._save_state``, run on a checkout before e1f4eed, whose
trainer state was one ``torch.save`` of the whole state into a buffer.)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: a checkout on PYTHONPATH (or an installed opdkit) is the one measured


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _run(layers: int):
    from opdkit.config import load_config
    from opdkit.models import random_model, shape_config
    from opdkit.setup import Inputs, Run, make_optimizer

    cfg = load_config(None, ["runtime.device=cpu", "publish.retries=0"])
    student = random_model(shape_config("qwen2-1.5b", num_hidden_layers=layers, eos_token_id=0, pad_token_id=0))
    optimizer = make_optimizer(cfg, student, torch.device("cpu"))
    for p in student.parameters():  # fill Adam's two moments (a zero step at lr 0 changes no weight)
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    inputs = Inputs(**{f.name: None for f in dataclasses.fields(Inputs)} | {"data_fingerprint": "bench"})
    run = Run(cfg, inputs, torch.device("cpu"), torch.float32, student, None, student, optimizer)
    run.lr_clock_start_s = 0.0
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default="/tmp/opdkit_state_memory")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    run = _run(args.layers)
    n_params = sum(p.numel() for p in run.student.parameters())
    weights = sum(p.numel() * p.element_size() for p in run.student.parameters())
    moments = {k: sum(s[k].numel() * s[k].element_size() for s in run.optimizer.state.values())
               for k in ("exp_avg", "exp_avg_sq")}
    largest = max(weights, *moments.values())
    import opdkit
    from opdkit.persist.trainer_state import save

    gc.collect()
    before = _status_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
    try:
        save(out, run, 1, 0.0, 0, lambda *a: None)
        peak = _status_kib("VmHWM") * 1024
        on_disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    gib = 2**30
    print(json.dumps({
        "code": "opdkit.persist.trainer_state.save", "opdkit": str(Path(opdkit.__file__).parent), "layers": args.layers,
        "params": n_params,
        "weights_gib": round(weights / gib, 3), "exp_avg_gib": round(moments["exp_avg"] / gib, 3),
        "exp_avg_sq_gib": round(moments["exp_avg_sq"] / gib, 3), "largest_group_gib": round(largest / gib, 3),
        "written_gib": round(on_disk / gib, 3), "rss_before_gib": round(before / gib, 3),
        "rss_peak_gib": round(peak / gib, 3), "increase_gib": round((peak - before) / gib, 3),
        "increase_over_largest_group": round((peak - before) / largest, 3),
    }))


if __name__ == "__main__":
    main()

"""How fast the saves of a run are: the trainer state (weights + AdamW) and the HF export, in GB/s.

    python bench/save_speed.py [--device cuda] [--shape qwen2-1.5b] [--dirs /dev/shm /tmp] [--reps 2]
    python bench/save_speed.py --device cpu --layers 2 --vocab 32000     # a few-GB state on a CPU

Builds a randomly initialised model of a reference shape (``opdkit.models.SHAPES``; no download) in
fp32 on the device with an AdamW state (one step on zero gradients creates it: fp32 weights + two
moments, ~21 GB for the 1.78B Qwen2-1.5B shape), then for each directory and repetition times
``trainer_state.save`` (to a fresh run directory, removed afterwards), ``trainer_state.restore`` of
what it wrote, and the export of a checkpoint in bf16 (the snapshot the training thread takes, then
``publish.export_checkpoint``, which the publisher runs in the background). One JSON line per
measurement on stdout: what, where, GB, seconds, GB/s.

It uses only calls that the previous opdkit had too, so the same script times an older kit for a
before/after: ``PYTHONPATH=/path/to/old/kit python bench/save_speed.py ...`` (``"kit"`` in each line
says which ran). With ``--device cuda`` on the H200 (the device lane):

    python bench/save_speed.py --device cuda --dirs /dev/shm/save_speed /tmp/save_speed --reps 2

should print state_save lines of >= 2 GB/s to /dev/shm (21.3 GB in <= 10 s).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import opdkit  # the kit on PYTHONPATH (this checkout's, or an older one for a before/after)
from opdkit.config import load_config
from opdkit.models import random_model, shape_config
from opdkit.persist import publish, trainer_state


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args, device: torch.device):
    overrides = {}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.vocab:
        overrides["vocab_size"] = args.vocab
    config = shape_config(args.shape, **overrides)
    t0 = time.perf_counter()
    model = random_model(config, device, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the moments
    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    cfg = load_config(None, ["publish.backoff_s=0", "publish.retries=0"])
    run = SimpleNamespace(cfg=cfg, student=model, optimizer=optimizer, ema=None, device=device,
                          lr_clock_start_s=0.0, run_id="bench",
                          inputs=SimpleNamespace(data_fingerprint="bench"))
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"what": "model", "shape": args.shape, "params_b": round(n / 1e9, 3), "device": str(device),
                      "build_s": round(time.perf_counter() - t0, 1), "kit": kit()}), flush=True)
    return run


def kit() -> str:
    return str(Path(opdkit.__file__).resolve().parents[1])


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def line(what: str, where: Path, nbytes: int, seconds: float, **extra) -> None:
    print(json.dumps({"what": what, "dir": str(where), "gb": round(nbytes / 1e9, 3), "s": round(seconds, 3),
                      "gb_per_s": round(nbytes / 1e9 / max(seconds, 1e-9), 3), "kit": kit(), **extra}), flush=True)


def time_state(run, where: Path, rep: int) -> None:
    out = where / f"run{rep}"
    shutil.rmtree(out, ignore_errors=True)
    _sync(run.device)
    t0 = time.perf_counter()
    path = trainer_state.save(out, run, step=1, elapsed=0.0, data_pos=0, log=lambda *_: None)
    seconds = time.perf_counter() - t0
    line("state_save", where, dir_bytes(path), seconds, rep=rep)
    state = trainer_state.peek(out)
    _sync(run.device)
    t0 = time.perf_counter()
    trainer_state.restore(run, state)
    _sync(run.device)
    line("state_restore", where, dir_bytes(path), time.perf_counter() - t0, rep=rep)
    shutil.rmtree(out, ignore_errors=True)


def time_export(run, where: Path, rep: int, snapshot) -> None:
    from opdkit.embedded.tokenizer import build_tokenizer
    from opdkit.engines.weights import export_state_dict

    root = where / f"ckpt{rep}"
    shutil.rmtree(root, ignore_errors=True)
    _sync(run.device)
    t0 = time.perf_counter()
    if snapshot is not None:  # this kit: cast on the device, copied into reused pinned memory
        sd = export_state_dict(run.student, dtype=torch.bfloat16, copy=snapshot.copy)
        snapshot.done()
    else:  # an older kit: an fp32 copy in host memory, cast by the export
        sd = export_state_dict(run.student)
    snap_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    final = publish.export_checkpoint(root, 1, state_dict=sd, model_config=run.student.config,
                                      tokenizer=build_tokenizer(), generation_config=None, meta={}, keep=1,
                                      retries=0, backoff_s=0.0, dtype=torch.bfloat16, log=lambda *_: None)
    write_s = time.perf_counter() - t1
    nbytes = dir_bytes(final)
    line("export", where, nbytes, snap_s + write_s, rep=rep, snapshot_s=round(snap_s, 3), write_s=round(write_s, 3))
    del sd
    shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="qwen2-1.5b")
    ap.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0: as it is)")
    ap.add_argument("--vocab", type=int, default=0, help="override the shape's vocabulary rows (0: as it is)")
    ap.add_argument("--dirs", nargs="+", default=["/dev/shm/save_speed", "/tmp/save_speed"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], choices=["state", "export"])
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    run = build(args, device)
    snapshot = publish.Snapshot() if hasattr(publish, "Snapshot") else None
    for d in map(Path, args.dirs):
        d.mkdir(parents=True, exist_ok=True)
        for rep in range(args.reps):
            if "state" not in args.skip:
                time_state(run, d, rep)
            if "export" not in args.skip:
                time_export(run, d, rep, snapshot)
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

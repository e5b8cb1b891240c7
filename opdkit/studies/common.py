"""What both studies share: the models, one set of real student rollouts, chunking, JSON, plots.

Chunking: hidden states are computed for a block of whole rows (``row_chunks``), and
full-vocabulary log-probs for about ``runtime.logprob_chunk`` positions at a time of those rows
(``position_chunks``), so a study at 7k tokens never holds (rows, T, V) fp32 logits at once.

Both studies score the same rollouts: ``studies.n_prompts`` eval prompts x
``studies.samples_per_prompt`` samples from the student (HF engine, ``rollout.temperature`` /
``top_p`` / ``max_new_tokens``), sample ``i`` seeded with ``sample_seed(seed, 0, i)``. The teacher
is the model at ``teacher.path`` (``teacher.source`` is a training choice and is not used here).
Models run in fp32 on any device: the studies measure differences at float tolerance, which bf16
would drown.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from opdkit import paths
from opdkit.config import Config, to_dict
from opdkit.data import encode_prompt, load_eval_examples
from opdkit.engines.base import Rollout
from opdkit.engines.hf import HFEngine
from opdkit.engines.sampling import sample_seed
from opdkit.models import load_model, load_tokenizer, pick_device, setup_torch
from opdkit.pairs import check_same_vocab, use_shared_vocab


@dataclass
class StudySetup:
    """Frozen fp32 student and teacher, the tokenizer, and the student's rollouts to score."""

    student: torch.nn.Module
    teacher: torch.nn.Module
    tokenizer: object
    pad_id: int
    rollout: Rollout
    device: torch.device
    sources: dict  # student / teacher / data paths, for the JSON
    rollout_seconds: float


def rollout_seeds(seed: int, n: int) -> list[int]:
    """Seeds of the study's samples 0..n-1 (step 0 of ``seed``)."""
    return [sample_seed(seed, 0, i) for i in range(n)]


def prepare(cfg: Config, progress: bool = True) -> StudySetup:
    """Load the models (fp32, frozen) and sample the student's rollouts for the studies."""
    setup_torch(cfg.runtime)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.runtime)
    s_path, t_path, d_path = paths.student_path(cfg), paths.teacher_path(cfg), paths.eval_data_path(cfg)
    tok = load_tokenizer(s_path)
    check_same_vocab(tok, load_tokenizer(t_path), s_path, t_path)
    student = load_model(s_path, device, torch.float32, "student model")
    teacher = load_model(t_path, device, torch.float32, "teacher model")
    use_shared_vocab(tok, {"student model": (s_path, student), "teacher model": (t_path, teacher)},
                     log=print if progress else (lambda _: None))
    examples = load_eval_examples([d_path])[: cfg.studies.n_prompts]  # every row: data.filters select training rows
    prompts = [encode_prompt(ex, tok, cfg.data) for ex in examples]
    G = cfg.studies.samples_per_prompt
    engine = HFEngine(student, tok, static_cache=cfg.rollout.static_cache)
    if progress:
        print(f"studies: sampling {len(prompts)} prompts x {G} from {s_path} on {device}", flush=True)
    t0 = time.perf_counter()
    ro = engine.sample(prompts, samples_per_prompt=G, seeds=rollout_seeds(cfg.seed, len(prompts) * G),
                       temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                       max_new_tokens=cfg.rollout.max_new_tokens)
    sources = {"student": str(s_path), "teacher": str(t_path), "data": str(d_path)}
    return StudySetup(student, teacher, tok, engine.pad_id, ro, device, sources, time.perf_counter() - t0)


def row_chunks(n_rows: int, T: int, positions_per_chunk: int) -> list[slice]:
    """Row slices of about ``positions_per_chunk`` completion positions each (at least one row):
    the rows whose hidden states are computed together (a decoder forward needs whole rows)."""
    step = max(1, positions_per_chunk // max(1, T))
    return [slice(s, min(n_rows, s + step)) for s in range(0, n_rows, step)]


def position_chunks(n_rows: int, T: int, positions_per_chunk: int) -> list[slice]:
    """Slices of the T completion positions such that ``n_rows`` rows x one slice hold at most
    ``positions_per_chunk`` positions (``runtime.logprob_chunk``; at least one position): the
    blocks whose (rows, positions, V) fp32 log-probs exist at a time. One slice when the rows fit."""
    width = max(1, positions_per_chunk // max(1, n_rows))
    return [slice(s, min(T, s + width)) for s in range(0, T, width)] or [slice(0, 0)]


def rollout_summary(ro: Rollout) -> dict:
    lengths_B = ro.completion_mask_B_T.sum(dim=1)
    return {
        "n_sequences": int(lengths_B.numel()),
        "n_tokens": int(lengths_B.sum()),
        "mean_response_len": float(lengths_B.float().mean()),
        "truncated_frac": float(ro.truncated_B.float().mean()),
    }


def study_header(cfg: Config, setup: StudySetup) -> dict:
    """Provenance shared by both JSONs: the studies params, seed, model and data paths, rollout size."""
    return {"seed": cfg.seed, "studies": to_dict(cfg.studies), "temperature": cfg.rollout.temperature,
            "top_p": cfg.rollout.top_p, "max_new_tokens": cfg.rollout.max_new_tokens, **setup.sources,
            **rollout_summary(setup.rollout), "device": str(setup.device)}


def jsonable(x):
    """Plain JSON: +-inf -> the strings "inf" / "-inf", NaN -> null (tuples -> lists)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
    return x


def write_json(result: dict, path: Path) -> dict:
    """Write ``result`` as strict JSON (see ``jsonable``) and return the written form."""
    out = jsonable(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, allow_nan=False) + "\n")
    return out


def log_floor(values: list[float]) -> float:
    """Where to draw zeros (and float-noise negatives) on a log axis: a decade under the smallest positive."""
    pos = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    return min(pos) / 10 if pos else 1e-12


def new_figure(ncols: int = 1, width: float = 5.5, height: float = 4.0):
    """A matplotlib Figure and its axes, drawn without pyplot (no global backend state; saves PNGs)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def tau_label(tau: float) -> str:
    return "inf" if math.isinf(tau) else f"{tau:g}"

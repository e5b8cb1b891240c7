"""Several teachers, and a teacher on a device of its own: which rows each teacher scores, where,
and how their scores come back to the loss.

- ``teachers`` (params) lists ``TeacherSpec(name, path, url)`` entries and ``data.teacher_column``
  names each row's teacher (``data.check_teachers`` refuses a row that names none of them before
  anything is written). The run holds a ``TeacherSet``: each member scores the rows that name it
  (``split_rows``), with its own model, and ``merge`` lays their scores out as one teacher's
  (sampled-token log-probs and top-K scattered into the micro-batch's rows; for the full-vocabulary
  losses each member's hidden states and head, ``full_logprobs``). The loss runs once per teacher on
  its rows (``row_groups``), so its sum is the step's loss and its metrics are per teacher
  (``chunk_metrics``, then ``finish_metrics``: ``teacher.<name>.loss`` / ``.kl`` / ``.tokens`` in
  train.jsonl). Every member shares the student's tokenizer (the pair checks run for each).
- ``teacher.device`` (one process): the teacher's weights live and run there; ``to_device`` moves
  its outputs to the student's device, and for the full-vocabulary losses a copy of its head
  (``scoring.head_on``, V x H) makes its logits there from its hidden states (B x T x H moved),
  never (B, T, V) tensors across devices.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from opdkit import loss_table
from opdkit.scores import TeacherScores
from opdkit.scoring import head_on


@dataclass
class TeacherSet:
    """The teachers of ``cfg.teachers``, in that order: ``members[i]`` scores the rows whose
    ``Batch.teacher_B`` is ``i`` (an HF model or a teacher that scores elsewhere)."""

    names: tuple[str, ...]
    members: list


DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_params(cfg) -> str | None:
    """Why ``teacher.device``, ``teachers`` or ``data.teacher_column`` cannot be used as set (None: fine)."""
    T, specs, column = cfg.teacher, cfg.teachers, cfg.data.teacher_column
    if T.device and not DEVICE_RE.match(T.device):
        return f"teacher.device={T.device!r}: expected '' (the student's device), cpu, cuda or cuda:N"
    if T.device and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return (f"teacher.device={T.device!r} is for one process; under torchrun each rank holds its teacher on its "
                "own GPU (runtime.teacher_sharding), or use teacher.source=vllm with a server (teacher.url)")
    if T.device and T.source != "model":
        return (f"teacher.device={T.device!r} places a teacher model (teacher.source=model); teacher.source={T.source} "
                "has none in this process (set teacher.device='')")
    if cfg.runtime.teacher_sharding == "fsdp" and (specs or T.source == "vllm"):
        return ("runtime.teacher_sharding=fsdp shards one teacher model like the student; with several teachers or "
                "teacher.source=vllm use runtime.teacher_sharding=replicate")
    if specs or column:
        if not (specs and column):
            return ("several teachers need both params key 'teachers' (name and path of each) and data.teacher_column "
                    f"(the column naming each row's teacher); got {len(specs)} teachers and "
                    f"data.teacher_column={column!r}")
        names = [t.name for t in specs]
        if len(set(names)) != len(names):
            return f"params key 'teachers': each name once; got {names}"
        if T.source not in ("model", "vllm"):
            return (f"params key 'teachers' routes rows to teacher models; teacher.source={T.source} is the student "
                    "itself")
        if T.path:
            return (f"teacher.path={T.path!r} and params key 'teachers' are both set: with several teachers each one's "
                    "path is in 'teachers' (set teacher.path='')")
        if loss_table.samples_from(cfg.loss) == "teacher":
            return ("loss.name=sft samples from one teacher; with several teachers use an OPD loss "
                    "(or loss.sft_source=reference)")
        if T.source == "model" and any(t.url for t in specs):
            return "a url in params key 'teachers' is for teacher.source=vllm (a server per teacher)"
    return None


def pick_device(setting: str, student_device: torch.device) -> torch.device:
    """The device ``teacher.device`` names ("" = the student's), checked against this machine."""
    if not setting:
        return student_device
    if setting == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"teacher.device={setting} but CUDA is not available here; use teacher.device=cpu or ''")
    device = torch.device(setting)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"teacher.device={setting}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                           f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


def device_of(teacher) -> torch.device:
    return next(teacher.parameters()).device


def to_device(ctx: TeacherScores, teacher, device: torch.device) -> TeacherScores:
    """``teacher_context``'s outputs on ``device`` (as they are where the teacher runs there): the
    tensors moved, the head replaced by its copy on ``device`` where hidden states are kept."""
    if device_of(teacher) == device:
        return ctx
    head = head_on(teacher, device) if ctx.hidden_B_T_H is not None else None
    return TeacherScores(**{k: v.to(device) for k, v in ctx.tensors().items()}, head=head)


def rows_tensor(rows, B: int, device) -> torch.Tensor:
    """A slice or index tensor of the batch's rows as an index tensor."""
    return torch.arange(B, device=device)[rows] if isinstance(rows, slice) else rows


def split_rows(batch, row_sets: list, n: int) -> list[list[torch.Tensor]]:
    """For each of ``n`` teachers i, for each of ``row_sets``: the batch rows among them naming teacher i."""
    t_B = batch.teacher_B
    rows = [rows_tensor(r, t_B.shape[0], t_B.device) for r in row_sets]
    return [[r[t_B[r] == i] for r in rows] for i in range(n)]


def merge(batch, row_sets: list, per_teacher: dict[int, list]) -> list[TeacherScores | None]:
    """One context per row set, laid out as a single teacher's (``step.teacher_context``) from each
    teacher's contexts of its rows (``per_teacher[i]``: one per non-empty subset of ``split_rows``)."""
    t_B = batch.teacher_B
    B = t_B.shape[0]
    subsets = split_rows(batch, row_sets, len(per_teacher))
    left = {i: list(ctxs) for i, ctxs in per_teacher.items()}
    out = []
    for j, rows in enumerate(row_sets):
        rows_b = rows_tensor(rows, B, t_B.device)
        merged: dict = {}
        for i, sub in enumerate(subsets):
            if not sub[j].numel():
                continue
            ctx = left[i].pop(0)
            local = torch.searchsorted(rows_b, sub[j])  # positions of teacher i's rows in this row set
            for key, v in ctx.tensors().items():
                if key == "hidden_B_T_H":
                    continue
                if key not in merged:
                    merged[key] = v.new_zeros((rows_b.numel(), *v.shape[1:]))
                merged[key][local] = v
            if ctx.hidden_B_T_H is not None:
                merged.setdefault("full_parts", []).append((local, ctx.head, ctx.hidden_B_T_H))
        out.append(TeacherScores(**merged) if merged else None)
    return out


def teacher_full_logprobs(ctx: TeacherScores, sl) -> torch.Tensor:
    """The teacher's log-probs over the vocabulary at completion positions ``sl``: (B, C, V) fp32,
    from one teacher's hidden states and head, or each of several teachers' on its rows."""
    if ctx.full_parts is None:
        return ctx.head(ctx.hidden_B_T_H[:, sl]).float().log_softmax(-1)
    out = None
    for local, head, h_b_T_H in ctx.full_parts:
        lp_b_C_V = head(h_b_T_H[:, sl]).float().log_softmax(-1)
        if out is None:
            n = sum(p[0].numel() for p in ctx.full_parts)
            out = lp_b_C_V.new_empty((n, *lp_b_C_V.shape[1:]))
        out[local] = lp_b_C_V
    return out


def row_groups(names: tuple[str, ...], batch, rows) -> dict[str, torch.Tensor] | None:
    """Several teachers: each teacher's rows within micro-batch ``rows`` (local indices), by name
    (``names``: the names of ``teachers``, in order: ``Batch.teacher_B`` numbers them), those with no
    row left out; None with one teacher."""
    if batch.teacher_B is None:
        return None
    if not names:
        raise ValueError("a batch of several teachers' rows (Batch.teacher_B) needs their names (teacher_names)")
    t_b = batch.teacher_B[rows]
    return {names[i]: (t_b == i).nonzero()[:, 0] for i in range(len(names)) if bool((t_b == i).any())}


def chunk_metrics(m: dict, parts: dict[str, tuple[dict, float]]) -> dict:
    """A chunk's metrics (``m``, combined over its teachers) plus per-teacher values kept as shares of
    the chunk's tokens, so that the token-weighted means of the micro-batch and rank combiners stay
    exact: ``teacher.<name>.frac`` (its share of the tokens), ``.loss`` (its per-token loss sum over
    the chunk's tokens) and ``.kl`` (its mean KL times its share); ``finish_metrics`` divides."""
    total = m.get("tokens") or 0.0
    out = dict(m)
    for name, (m_t, loss_sum) in parts.items():
        frac = m_t["tokens"] / total if total else 0.0
        out[f"teacher.{name}.frac"] = frac
        out[f"teacher.{name}.loss"] = loss_sum / total if total else 0.0
        out[f"teacher.{name}.kl"] = (m_t.get("kl") or 0.0) * frac
    return out


def finish_metrics(m: dict, names: tuple[str, ...]) -> dict:
    """train.jsonl's per-teacher keys from ``chunk_metrics``' shares (over the whole step):
    ``teacher.<name>.loss`` (its mean per-token loss), ``teacher.<name>.kl`` (its mean KL) and
    ``teacher.<name>.tokens``; a teacher with no row in the step gets None."""
    out = dict(m)
    for name in names:
        frac = out.pop(f"teacher.{name}.frac", 0.0) or 0.0
        for key in ("loss", "kl"):
            v = out.pop(f"teacher.{name}.{key}", None)
            out[f"teacher.{name}.{key}"] = v / frac if frac and v is not None else None
        out[f"teacher.{name}.tokens"] = round(frac * (m.get("tokens") or 0.0))
    return out

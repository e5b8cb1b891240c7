"""Offline OPD (``rollout.source: offline``): rollouts of a fixed policy, drawn and teacher-scored once
(``opdkit offline-rollouts``, ``opdkit.offline_draw``), then the OPD update on them with no teacher
model in the training process (the Lightning OPD setting, arXiv 2604.13010).

The pool (one parquet file, ``rollout.offline_file``) holds N prompts x G samples of the policy μ
(a model directory; by default the run's student at step 0): the prompts the online run of the same
seed would draw in its first N / P steps, each sample drawn with that run's per-sample seed, so the
pool is what the online run would train on if its rollout weights never changed. Per sample: the
prompt's ids and data row, the sample seed, the completion's ids (through EOS), log μ of each
completion token as the engine recorded it while sampling (the behaviour log-probs), the teacher's
log-prob of each token and, where asked, the teacher's top-K ids and log-probs at each position.
The file's metadata names the policy, the teacher and the data (paths and fingerprints), the
rollout settings, and the seconds drawing and scoring took.

Training reads the step's prompts from the pool (the run's ``data.order`` over the pool's N prompts,
epoch after epoch: ``Pool.sample``, in place of an engine) and their stored teacher scores (``Pool.score``,
in place of a teacher). The update, with the importance ratio r = p_S / μ per token
(``rollout.offline_ratio``), has the expected gradient (per position t, the prefix y_<t drawn by μ;
tests/test_offline.py enumerates every sequence of a tiny policy):

- k1, ``behaviour`` (old_logp = log μ; within the PPO clip): sum_t E_{y<t ~ μ} ∇KL(p_S || p_T)(y<t),
  the online update's per-position reverse KL with the prefixes drawn by μ instead of p_S (the
  token ratio corrects the sampled token, not the prefix: that would need the product of the
  prefix's ratios). k2 the same; k3 sum_t E_{y<t ~ μ} ∇KL(p_T || p_S)(y<t).
- ``none`` (old_logp = the current student's log-probs, ratio 1): k1 and k2 follow
  sum_t E_{y<t ~ μ} ∇E_{v ~ μ}[½ (log p_S(v) - log p_T(v))²], a μ-weighted squared log-ratio (0 iff
  p_S = p_T on μ's support), not a KL; k3 follows ∇E_{v ~ μ}[p_T(v) / p_S(v) + log p_S(v)].
- topk_fkl (a loss over the whole top-K + tail at each stored prefix): no token ratio enters; it
  follows sum_t E_{y<t ~ μ} ∇KL(q_T || q_S)(y<t), as one-step-off rollouts take stale prefixes
  (``opdkit.overlap``).

Losses (``refusal``): k1, k2, k3 (the teacher's sampled-token log-probs) and topk_fkl (its top-K)
train offline; fkl, rkl, jsd need the teacher's whole distribution at every stored position (V
floats a token: 0.6 MB at V = 151,936), topk_rkl the teacher at the current student's top-K, which
moves as the student trains, and sft trains on teacher samples or references, not a policy's
rollouts. Also refused: a reward (its policy gradient is stated for the student's own samples),
several teachers, a privileged or vLLM teacher, rollout.overlap, and torchrun (not run there yet).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from opdkit import loss_table, opd
from opdkit.engines.base import Rollout, left_pad
from opdkit.scores import TeacherScores
from opdkit.scoring import completion_hidden, token_logprobs, unwrap

FORMAT = 1
META_KEY = b"opdkit.offline"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json")  # what a model directory's fingerprint covers


class OfflineError(ValueError):
    """An offline pool that cannot serve these params (the message names the file and the key)."""


def model_fingerprint(path: str | Path) -> str:
    """sha256 over a model directory's config, tokenizer and weight files (names and bytes): which
    model drew or scored a pool."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES):
        h.update(f"{f.name}\0".encode())
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def refusal(cfg) -> str | None:
    """Why these params cannot train on a pool (None when they can, or when rollout.source=live)."""
    R, L = cfg.rollout, cfg.loss
    if R.source != "offline":
        return None
    spec = loss_table.spec(L.name)
    if loss_table.samples_from(L) != "student":
        return ("rollout.source=offline trains on a policy's rollouts; loss.name=sft trains on teacher samples or "
                "reference solutions (set rollout.source=live)")
    if not loss_table.trains_offline(L.name):
        return (f"rollout.source=offline with loss.name={L.name}: its gradient, that of {spec.divergence}, needs the "
                "teacher's distribution over the whole vocabulary at every position the current student puts mass "
                "on, which a pool cannot hold (fkl / rkl / jsd: V floats a token; topk_rkl: the current student's "
                "top-K moves as it trains); use k1, k2, k3 (sampled-token log-probs) or topk_fkl (the teacher's "
                "top-K), or rollout.source=live")
    if not R.offline_file:
        return "rollout.source=offline needs rollout.offline_file: the parquet `opdkit offline-rollouts` wrote"
    why = (
        (L.reward_weight != 0,
         "loss.reward_weight: the reward's policy gradient is stated for the student's own samples"),
        (bool(cfg.teachers), "params key 'teachers': a pool is scored by one teacher"),
        (cfg.teacher.source != "model", f"teacher.source={cfg.teacher.source}: a pool is scored by a teacher model"),
        (bool(R.overlap), "rollout.overlap=1: there is no rollout to draw ahead"),
        (int(os.environ.get("WORLD_SIZE", "1")) > 1, "torchrun: offline training runs in one process (untested there)"),
    )
    return next((f"rollout.source=offline does not combine with {w}" for c, w in why if c), None)


@dataclass
class Pool:
    """A pool read back (``read_pool``): per pool prompt p its data row, prompt ids and G samples;
    ``Pool.sample`` / ``Pool.score`` serve a training step (module docstring)."""

    path: Path
    meta: dict
    rows: list[int]  # p -> its row in the data (the index into load_examples' list)
    prompt_ids: list[list[int]]
    completions: list[list[list[int]]]  # p -> G completions (their masked-in ids)
    truncated: list[list[bool]]
    behaviour_logp: list[list[list[float]]]
    teacher_logp: list[list[list[float]]]
    topk_ids: list[list[list[list[int]]]] | None  # p -> G -> T -> K, or None (not stored)
    topk_logp: list[list[list[list[float]]]] | None
    sha256: str = ""
    # set for a run (``serve``): the run's settings, and the step being served
    ratio: str = "behaviour"
    topk: int = 0
    policy: tuple = (1.0, 1.0)  # (temperature, top_p) of p_S
    pad_side: str = "left"
    chunk: int = 2048
    unpadded: bool = False
    pad_id: int = 0
    model: object = None  # the live student (sync_weights), for offline_ratio=none
    _served: tuple | None = None  # (rollout, teacher tensors) of the step drawn last
    reads_live_model = False  # an engine's attribute: the pool holds its samples, it draws nothing

    def __post_init__(self):
        self._where: dict[tuple, int] = {}
        for p, ids in enumerate(self.prompt_ids):
            self._where.setdefault(tuple(ids), p)  # rows with the same prompt share the first one's samples

    @property
    def samples_per_prompt(self) -> int:
        return self.meta["samples_per_prompt"]

    def serve(self, cfg, pad_id: int) -> Pool:
        """This pool set up to serve a run of ``cfg`` (checked by ``check_pool`` first)."""
        need = loss_table.teacher_need(cfg.loss, cfg.rollout)
        return replace(self, ratio=cfg.rollout.offline_ratio, topk=cfg.loss.topk if need == "topk" else 0,
                       policy=loss_table.update_policy(cfg.loss, cfg.rollout), pad_side=cfg.data.pad_side,
                       chunk=cfg.runtime.logprob_chunk, unpadded=cfg.runtime.unpadded_rows, pad_id=pad_id)

    # --- the engine's side -------------------------------------------------------------------

    def sync_weights(self, model) -> None:
        """The pool's samples stay μ's; the live student is kept for ``offline_ratio=none``."""
        self.model = model

    def sample(self, prompts, *, samples_per_prompt, seeds, temperature, top_p, max_new_tokens,
               logprobs=True) -> Rollout:
        """The stored samples of ``prompts`` (``seeds``: the stored ones were drawn with the pool's seeds)
        laid out as an engine's rollout: sampling log-probs = log μ (``offline_ratio=behaviour``) or the
        current student's, recomputed without grad (``none``: ratio 1)."""
        got = (samples_per_prompt, temperature, top_p, max_new_tokens)
        want = tuple(self.meta[k] for k in ("samples_per_prompt", "temperature", "top_p", "max_new_tokens"))
        if got != want:
            raise OfflineError(f"offline pool {self.path}: drawn with (samples per prompt, temperature, top-p, new "
                               f"tokens) {want}, asked for {got}")
        missing = [i for i, ids in enumerate(prompts) if tuple(ids) not in self._where]
        if missing:
            raise OfflineError(f"offline pool {self.path}: prompt {missing[0]} of the step is not in the pool (another "
                               "data file, prompt format or chat template than the pool's)")
        device = next(self.model.parameters()).device if self.model is not None else torch.device("cpu")
        where = [self._where[tuple(ids)] for ids in prompts]
        G = samples_per_prompt
        pick = [(p, g) for p in where for g in range(G)]  # prompt-major, as the engines lay rows out
        prompt_ids_B_Sp, prompt_mask_B_Sp = left_pad([self.prompt_ids[p] for p, _ in pick], self.pad_id, device)
        comp = [self.completions[p][g] for p, g in pick]
        T = max(1, max(map(len, comp)))

        def padded(values, fill, dtype):
            out = torch.full((len(pick), T), fill, dtype=dtype)
            for b, v in enumerate(values):
                out[b, : len(v)] = torch.tensor(v, dtype=dtype)
            return out.to(device)

        ids_B_T = padded(comp, self.pad_id, torch.long)
        mask_B_T = padded([[1.0] * len(c) for c in comp], 0.0, torch.float)
        rollout = Rollout(prompt_ids_B_Sp, prompt_mask_B_Sp, ids_B_T, mask_B_T,
                          padded([self.behaviour_logp[p][g] for p, g in pick], 0.0, torch.float),
                          torch.tensor([self.truncated[p][g] for p, g in pick], device=device),
                          torch.arange(len(where), device=device).repeat_interleave(G))
        stored = {"logp_B_T": padded([self.teacher_logp[p][g] for p, g in pick], 0.0, torch.float)}
        if self.topk:
            K = self.topk
            ids_B_T_K = torch.zeros((len(pick), T, K), dtype=torch.long)
            logp_B_T_K = torch.zeros((len(pick), T, K))
            for b, (p, g) in enumerate(pick):
                n = len(self.topk_ids[p][g])
                ids_B_T_K[b, :n] = torch.tensor(self.topk_ids[p][g], dtype=torch.long)[:, :K]
                logp_B_T_K[b, :n] = torch.tensor(self.topk_logp[p][g])[:, :K]
            stored |= {"topk_ids_B_T_K": ids_B_T_K.to(device), "topk_logp_B_T_K": logp_B_T_K.to(device)}
        if self.ratio == "none":
            rollout.sampling_logp_B_T = self._current_logp(rollout)
        self._served = (rollout, stored)
        return rollout

    @torch.no_grad()
    def _current_logp(self, rollout: Rollout) -> torch.Tensor:
        """log p_S of the stored tokens under the current student (as the loss computes them)."""
        batch = opd.Batch(rollout, rollout.prompt_ids_B_Sp, rollout.prompt_mask_B_Sp, self.pad_side)
        _, head = unwrap(self.model)
        h_B_T_H = completion_hidden(self.model, opd.student_geometry(batch), self.unpadded)
        logp_B_T = token_logprobs(head, h_B_T_H, rollout.completion_ids_B_T, self.chunk, *self.policy)
        return torch.where(rollout.completion_mask_B_T != 0, logp_B_T, torch.zeros_like(logp_B_T))

    # --- the teacher's side --------------------------------------------------------------------

    def score(self, k: int, batch, row_sets) -> list[TeacherScores]:
        """The stored teacher scores of the step ``sample`` served, for each of ``row_sets`` (``k``, the top-K the
        step asks for, was fixed when the pool was drawn)."""
        if self._served is None or batch.rollout is not self._served[0]:
            raise RuntimeError("offline pool: the batch scored is not the one the pool served last (a bug)")
        stored = self._served[1]
        return [TeacherScores(**{k: v[rows] for k, v in stored.items()}) for rows in row_sets]


def write_pool(path: str | Path, records: list[dict], meta: dict) -> None:
    """``records`` (one per sample, ``draw_pool``'s fields) as parquet with ``meta`` in the schema's
    metadata; atomic (a temporary file renamed into place)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {k: [r[k] for r in records] for k in records[0]}
    types = {"prompt_index": pa.int64(), "row": pa.int64(), "sample": pa.int32(), "seed": pa.int64(),
             "example_id": pa.string(), "prompt_ids": pa.list_(pa.int32()), "completion_ids": pa.list_(pa.int32()),
             "truncated": pa.bool_(), "behaviour_logp": pa.list_(pa.float32()), "teacher_logp": pa.list_(pa.float32()),
             "teacher_topk_ids": pa.list_(pa.list_(pa.int32())), "teacher_topk_logp": pa.list_(pa.list_(pa.float32()))}
    table = pa.table({k: pa.array(v, type=types[k]) for k, v in columns.items()})
    table = table.replace_schema_metadata({META_KEY: json.dumps({"format": FORMAT, **meta}).encode()})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_meta(path: str | Path) -> dict:
    """A pool's metadata (the file's schema metadata); ``OfflineError`` when it is not a pool."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise OfflineError(f"rollout.offline_file {p} does not exist: write it with "
                           f"`opdkit offline-rollouts --out {p}`")
    try:
        raw = (pq.read_schema(p).metadata or {}).get(META_KEY)
    except (OSError, ValueError) as e:
        raise OfflineError(f"rollout.offline_file {p} is not a readable parquet file "
                           f"({type(e).__name__}: {e})") from None
    if raw is None:
        raise OfflineError(f"rollout.offline_file {p} holds no offline pool (no {META_KEY.decode()} metadata): write "
                           "it with `opdkit offline-rollouts`")
    meta = json.loads(raw)
    if meta.get("format") != FORMAT:
        raise OfflineError(f"rollout.offline_file {p}: pool format {meta.get('format')}, this opdkit reads {FORMAT}")
    return meta


def read_pool(path: str | Path) -> Pool:
    """The pool at ``path``, grouped by prompt (rows in order of prompt_index, then sample)."""
    import pyarrow.parquet as pq

    meta = read_meta(path)
    cols = pq.ParquetFile(path).read().to_pydict()  # (as data.read_table: not read_table's dataset layer)
    n, G = meta["n_prompts"], meta["samples_per_prompt"]
    if len(cols["prompt_index"]) != n * G:
        raise OfflineError(f"rollout.offline_file {path}: {len(cols['prompt_index'])} samples, its metadata says "
                           f"{n} prompts x {G}")
    order = sorted(range(n * G), key=lambda i: (cols["prompt_index"][i], cols["sample"][i]))

    def grouped(name):
        return [[cols[name][order[p * G + g]] for g in range(G)] for p in range(n)]

    topk = "teacher_topk_ids" in cols
    return Pool(Path(path), meta, [cols["row"][order[p * G]] for p in range(n)],
                [cols["prompt_ids"][order[p * G]] for p in range(n)], grouped("completion_ids"), grouped("truncated"),
                grouped("behaviour_logp"), grouped("teacher_logp"), grouped("teacher_topk_ids") if topk else None,
                grouped("teacher_topk_logp") if topk else None, sha256=file_sha256(path))


def check_pool(cfg, pool: Pool, teacher_path: Path | None, data_fingerprint: str) -> None:
    """Raise ``OfflineError`` unless ``pool`` can serve a run of ``cfg`` on this teacher and data."""
    m, R, where = pool.meta, cfg.rollout, f"rollout.offline_file {pool.path}"
    for key in ("samples_per_prompt", "temperature", "top_p", "max_new_tokens"):
        if getattr(R, key) != m[key]:
            raise OfflineError(f"{where} was drawn with rollout.{key}={m[key]}; these params set {getattr(R, key)}: "
                               "train with the pool's value or draw a pool with yours")
    if m["data_fingerprint"] != data_fingerprint:
        raise OfflineError(f"{where} was drawn from other training rows ({m['data']}, filters as then) than these "
                           "params select: point data.train and data.filters at the pool's data, or draw a pool "
                           "from yours")
    if teacher_path is None or model_fingerprint(teacher_path) != m["teacher_fingerprint"]:
        raise OfflineError(f"{where} was scored by the teacher {m['teacher']} (other weights than teacher.path="
                           f"{teacher_path}): set teacher.path to the pool's teacher, or draw a pool with yours")
    if loss_table.teacher_need(cfg.loss, R) == "topk" and m["topk"] < cfg.loss.topk:
        raise OfflineError(f"{where} holds the teacher's top-{m['topk']}; loss.topk={cfg.loss.topk} needs more: "
                           f"draw it with --topk {cfg.loss.topk}")


def pool_inputs(cfg, inputs, log=lambda _: None):
    """The run's ``Inputs`` for ``rollout.source=offline``: the pool read and checked, the training
    examples restricted to the pool's prompts (in the pool's order: ``data.order`` walks them), and a
    data fingerprint that covers the pool file (a run resumes only on the same pool)."""
    pool = read_pool(cfg.rollout.offline_file)
    check_pool(cfg, pool, inputs.teacher_path, inputs.data_fingerprint)
    if max(pool.rows) >= len(inputs.examples):
        raise OfflineError(f"rollout.offline_file {pool.path}: data row {max(pool.rows)} is past the "
                           f"{len(inputs.examples)} rows these params select")
    fp = hashlib.sha256(f"{inputs.data_fingerprint}\0{pool.sha256}".encode()).hexdigest()
    m = pool.meta
    log(f"offline pool {pool.path}: {m['n_prompts']} prompts x {m['samples_per_prompt']} samples of {m['policy']}, "
        f"scored by {m['teacher']} (drawn in {m['seconds']['rollout']:.1f}s, scored in {m['seconds']['score']:.1f}s)")
    return replace(inputs, examples=[inputs.examples[r] for r in pool.rows], data_fingerprint=fp, offline=pool)


def behaviour_is_student(pool: Pool, student_path: Path) -> bool:
    """Whether the pool's policy is the run's starting student (the same weights)."""
    return pool.meta["policy_fingerprint"] == model_fingerprint(student_path)

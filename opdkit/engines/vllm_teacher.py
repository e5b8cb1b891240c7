"""The teacher in vLLM (``teacher.source: vllm``): it scores the student's samples through vLLM's
prompt log-probs, so the training process holds none of its weights.

Each scored row is sent as one token-id prompt, the teacher's prompt followed by the sampled
completion, with ``prompt_logprobs = K`` (``loss.topk`` for ``topk_fkl``, 0 for k1 / k2 / k3) and
one generated token (which is thrown away). vLLM returns, for every prompt position i >= 1, the
log-prob of token i given tokens 0..i-1 and the K most probable ids there; completion token t sits
at position ``n_prompt + t``. vLLM computes prompt log-probs from the raw logits (log-softmax at
temperature 1, no sampling processors: ``prompt_logprob.py`` in its GPU model runner), which is the
kit's teacher p_T, over every embedding row of the model it serves: so a vLLM teacher must hold
exactly the tokenizer's ids (the pair checks refuse one with padding rows and name the fix,
``opdkit vocab-cut``, which writes a copy cut to them; the HF teacher's ``SharedVocabHead``
renormalises over the same ids). Two places to run it:

- ``teacher.url`` set: a vLLM OpenAI-compatible server the user started (``vllm serve DIR
  --max-logprobs K``); ``ServerTeacher`` posts one ``/v1/completions`` request per step (every row's
  prompt, ``prompt_logprobs``, ``return_token_ids``) and checks the answer: the echoed token ids are
  the ones sent, every scored position holds the sampled token, every value is a log-probability.
  A server that cannot be reached, answers with an error or answers something else stops the step
  with ``VLLMTeacherError`` (the run exits 1, its last state kept); there are no zero scores.
- ``teacher.url`` empty: ``EngineTeacher``, a ``vllm.LLM`` of the teacher on the student's GPU in
  an engine process of its own (vLLM's sleep mode allows one engine per process, and the student's
  vLLM engine runs in the training process), started by spawn (a forked child cannot use CUDA once
  the training process has initialised it), asleep between scorings (level 1: weights kept in CPU
  memory, KV cache freed) so the update has the GPU; ``teacher.gpu_memory_utilization`` bounds it
  while awake. It is built before the student's engine (``setup.build_run``).

Which losses: prompt log-probs give the sampled token's log-prob and the top K of each position,
not the full distribution, so fkl / rkl / jsd are refused with ``teacher.source=vllm``
(``check_params``); k1 / k2 / k3 (sampled tokens) and topk_fkl (top K) run.

``completion_request``, ``parse_scores``, ``scores_to_context`` and ``vocab_cut`` are plain
functions, tested without vLLM (tests/test_vllm_teacher.py: a fake server on the loopback that
answers with the HF teacher's log-probs).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import torch

from opdkit import loss_table
from opdkit.engines import vllm as vllm_engine
from opdkit.scores import TeacherScores

NEG_INF_AS = -9999.0  # vLLM's server writes -inf log-probs as this (clamp_prompt_logprobs)
# the colocated engine's max_model_len, in the student's prompt + completion tokens: x1, or with teacher.tokenizer=own
# (the teacher's own tokens of the same text) x4, the most bytes a character takes in UTF-8 (a byte-level teacher)
XTOK_LEN = {"shared": 1, "own": 4}


class VLLMTeacherError(RuntimeError):
    """The vLLM teacher could not score a step (the message says what it answered, and what to do)."""


def check_params(cfg) -> str | None:
    """Why these params cannot score with a vLLM teacher (None: they can)."""
    if cfg.teacher.source != "vllm":
        return None
    need = loss_table.teacher_need(cfg.loss, cfg.rollout)
    if need == "full":
        return (f"loss.name={cfg.loss.name} needs the teacher's full distribution; teacher.source=vllm scores through "
                "prompt log-probs, which give the sampled token and the top-k only: use k1, k2, k3 or topk_fkl, or "
                "teacher.source=model")
    if cfg.data.pad_side != "left":
        return (f"data.pad_side={cfg.data.pad_side} lays the HF teacher's scored rows out with pads inside them; "
                "teacher.source=vllm scores each row unpadded: use data.pad_side=left or teacher.source=model")
    urls = [cfg.teacher.url] if not cfg.teachers else [t.url for t in cfg.teachers]
    for url in urls:
        if url and not url.startswith(("http://", "https://")):
            return f"teacher url {url!r}: expected the base URL of a vLLM server, http://HOST:PORT"
    if sum(not u for u in urls) > 1:
        return "several teachers with teacher.source=vllm: give each a url (a server each); one may be colocated"
    if not all(urls) and not vllm_engine.available():
        return ("teacher.source=vllm without a url runs a vLLM engine here, and vLLM is not installed: pip install -e "
                "'.[vllm]', or give teacher.url (a server), or use teacher.source=model")
    if not all(urls) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "teacher.source=vllm without a url colocates an engine in one process; under torchrun set teacher.url"
    return None


def prompt_logprobs_k(cfg) -> int:
    """K of the requests: the top-K for topk_fkl, else 0 (the sampled token's log-prob only)."""
    return cfg.loss.topk if loss_table.teacher_need(cfg.loss, cfg.rollout) == "topk" else 0


def sequences(batch, rows) -> tuple[list[list[int]], list[int], list[int]]:
    """The rows' token-id prompts for the teacher: its prompt (pads dropped) then the completion
    (to its mask's end); with each row's prompt and completion lengths."""
    ro = batch.rollout
    p_ids, p_mask = batch.teacher_prompt_ids_B_Sp[rows].tolist(), batch.teacher_prompt_mask_B_Sp[rows].tolist()
    c_ids, c_len = ro.completion_ids_B_T[rows].tolist(), ro.completion_mask_B_T[rows].sum(dim=1).long().tolist()
    seqs, n_prompt = [], []
    for ids, mask, comp, n in zip(p_ids, p_mask, c_ids, c_len):
        prompt = [t for t, m in zip(ids, mask) if m]
        seqs.append(prompt + comp[:n])
        n_prompt.append(len(prompt))
    return seqs, n_prompt, c_len


def completion_request(model: str, seqs: list[list[int]], k: int) -> dict:
    """The body of one ``/v1/completions`` request scoring ``seqs`` (token-id prompts)."""
    return {"model": model, "prompt": seqs, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k,
            "return_token_ids": True, "add_special_tokens": False}


def _position(entry, where: str) -> dict[int, float]:
    """One position's {token id: log-prob}, from the server's JSON ({"id": {"logprob": ...}}) or an
    in-process ``Logprob`` mapping."""
    if not isinstance(entry, dict) or not entry:
        raise VLLMTeacherError(f"{where}: expected the log-probs of that position, got {entry!r}")
    out = {}
    for key, v in entry.items():
        lp = v["logprob"] if isinstance(v, dict) else v.logprob
        lp = float(lp)
        out[int(key)] = -math.inf if lp <= NEG_INF_AS else lp
    return out


def parse_scores(prompt_logprobs, sent: list[int], echoed: list[int] | None, n_prompt: int, n_comp: int, k: int,
                 n_vocab: int, where: str) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """One row's teacher scores from vLLM's prompt log-probs: the sampled tokens' log-probs
    (n_comp,), and the top-``k`` ids and log-probs (n_comp, k) by descending log-prob; checked (the
    echoed prompt is the one sent, one entry per position, each holding the sampled token, log-probs
    <= 0, ids inside the tokenizer's ``n_vocab``)."""
    if echoed is not None and list(echoed) != list(sent):
        raise VLLMTeacherError(f"{where}: the teacher scored other tokens than were sent (its prompt_token_ids differ)")
    if prompt_logprobs is None or len(prompt_logprobs) != len(sent):
        got = None if prompt_logprobs is None else len(prompt_logprobs)
        raise VLLMTeacherError(f"{where}: expected prompt log-probs for {len(sent)} positions, got {got}")
    logp, top_ids, top_lp = [], [], []
    for t in range(n_comp):
        i = n_prompt + t
        pos = _position(prompt_logprobs[i], f"{where}, completion token {t}")
        if sent[i] not in pos:
            raise VLLMTeacherError(f"{where}, completion token {t}: the teacher's answer has no log-prob for the "
                                   f"sampled token {sent[i]} (positions shifted?)")
        if any(v > 1e-3 or math.isnan(v) for v in pos.values()):
            raise VLLMTeacherError(f"{where}, completion token {t}: values that are not log-probabilities: {pos}")
        if max(pos) >= n_vocab:
            raise VLLMTeacherError(f"{where}, completion token {t}: id {max(pos)} is past the tokenizer's {n_vocab} "
                                   "ids: the teacher has padding rows (serve the copy `opdkit vocab-cut` writes)")
        logp.append(pos[sent[i]])
        if k:
            best = sorted(pos.items(), key=lambda kv: -kv[1])[:k]
            if len(best) < k:
                raise VLLMTeacherError(f"{where}, completion token {t}: {len(best)} top log-probs, expected {k} "
                                       "(prompt_logprobs)")
            top_ids.append([i_ for i_, _ in best])
            top_lp.append([v for _, v in best])
    return logp, top_ids, top_lp


def scores_to_context(scores: list[tuple], T: int, k: int, device) -> TeacherScores:
    """Rows' ``parse_scores`` as ``step.teacher_context``'s tensors: ``logp_B_T`` (0 past each
    completion), and with k > 0 ``topk_ids_B_T_K`` / ``topk_logp_B_T_K``."""
    B = len(scores)
    logp_B_T = torch.zeros((B, T))
    ids_B_T_K, lp_B_T_K = torch.zeros((B, T, k), dtype=torch.long), torch.zeros((B, T, k))
    for b, (logp, top_ids, top_lp) in enumerate(scores):
        n = len(logp)
        logp_B_T[b, :n] = torch.tensor(logp)
        if k and n:
            ids_B_T_K[b, :n] = torch.tensor(top_ids)
            lp_B_T_K[b, :n] = torch.tensor(top_lp)
    ctx = TeacherScores(logp_B_T.to(device))
    if k:
        ctx.topk_ids_B_T_K, ctx.topk_logp_B_T_K = ids_B_T_K.to(device), lp_B_T_K.to(device)
    return ctx


class _Scorer:
    """What both kinds share: ``score`` (``step.score_rows``' protocol) over ``_prompt_logprobs``."""

    name: str
    n_vocab: int

    def score(self, k: int, batch, row_sets: list) -> list[TeacherScores]:
        """The teacher's scores of each of ``row_sets`` (one request for all their rows): the sampled
        tokens' log-probs, and with ``k`` > 0 the top-k (``prompt_logprobs_k``)."""
        per_set = [sequences(batch, rows) for rows in row_sets]
        flat = [s for seqs, _, _ in per_set for s in seqs]
        answers = self._prompt_logprobs(flat, k) if flat else []
        T, device = batch.rollout.completion_ids_B_T.shape[1], batch.rollout.completion_ids_B_T.device
        out, i = [], 0
        for seqs, n_prompt, n_comp in per_set:
            scores = []
            for b in range(len(seqs)):
                plp, echoed = answers[i]
                scores.append(parse_scores(plp, flat[i], echoed, n_prompt[b], n_comp[b], k, self.n_vocab,
                                           f"the vLLM teacher {self.name}, row {b}"))
                i += 1
            out.append(scores_to_context(scores, T, k, device))
        return out


class ServerTeacher(_Scorer):
    """A vLLM OpenAI-compatible server (``vllm serve DIR``) at ``url`` (module docstring)."""

    def __init__(self, url: str, path: Path, n_vocab: int, timeout_s: float, log=print):
        self.url, self.n_vocab, self.timeout_s = url.rstrip("/"), n_vocab, timeout_s
        self.name = self.url
        models = self._call("GET", "/v1/models", None).get("data") or []
        if not models:
            raise VLLMTeacherError(f"the vLLM server at {self.url} serves no model (/v1/models is empty)")
        same = [m for m in models if m.get("root") and _same_dir(m["root"], path)]
        card = same[0] if same else models[0]
        if len(models) > 1 and not same:
            raise VLLMTeacherError(f"the vLLM server at {self.url} serves {[m.get('id') for m in models]}, none from "
                                   f"{path}; serve the teacher of teacher.path there")
        self.model = card["id"]
        if not same:
            log(f"warning: the vLLM teacher server {self.url} serves {self.model!r} from {card.get('root')!r}, not "
                f"visibly {path} (the pair checks read {path}): make sure it is the same teacher")

    def _call(self, method: str, route: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("error", {}).get("message") or detail
            except (json.JSONDecodeError, AttributeError):
                pass
            raise VLLMTeacherError(f"the vLLM teacher server at {self.url} answered {route} with HTTP {e.code}: "
                                   f"{str(detail)[:500]}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise VLLMTeacherError(f"the vLLM teacher server at {self.url} cannot be reached ({reason}; "
                                   f"teacher.timeout_s={self.timeout_s:g}): start it (vllm serve DIR --max-logprobs K) "
                                   "or fix teacher.url"
                                   ) from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise VLLMTeacherError(f"the vLLM teacher server at {self.url} answered {route} with something that is not "
                                   f"JSON: {text[:200]!r}") from None

    def _prompt_logprobs(self, seqs: list[list[int]], k: int) -> list[tuple]:
        answer = self._call("POST", "/v1/completions", completion_request(self.model, seqs, k))
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(seqs):
            raise VLLMTeacherError(f"the vLLM teacher server at {self.url} answered {len(choices)} choices for "
                                   f"{len(seqs)} prompts")
        return [(c.get("prompt_logprobs"), c.get("prompt_token_ids")) for c in choices]


def _same_dir(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


class EngineTeacher(_Scorer):
    """The teacher as a ``vllm.LLM`` in an engine process of its own (module docstring)."""

    def __init__(self, cfg, path: Path, n_vocab: int, device: torch.device):
        vllm = vllm_engine._require_vllm(device, "teacher.source=vllm without teacher.url",
                                         "teacher.url (a server) or teacher.source=model")
        if vllm_engine.ENGINES_BUILT:
            raise RuntimeError("the colocated vLLM teacher must be built before the student's vLLM engine")
        self.name, self.n_vocab = str(path), n_vocab
        R = cfg.rollout
        rows = R.prompts_per_step * R.samples_per_prompt
        kw = dict(model=str(path), tokenizer=str(path), skip_tokenizer_init=True, dtype="bfloat16", seed=cfg.seed,
                  max_model_len=(R.max_prompt_tokens + R.max_new_tokens) * XTOK_LEN[cfg.teacher.tokenizer] + 1,
                  max_num_seqs=max(1, rows),
                  gpu_memory_utilization=cfg.teacher.gpu_memory_utilization, enable_sleep_mode=device.type == "cuda",
                  enable_prefix_caching=False, max_logprobs=max(20, prompt_logprobs_k(cfg)), runner="generate",
                  # prefills only: no compile, no graphs (a short start)
                  logprobs_mode="raw_logprobs", enforce_eager=True)
        # its own engine process (one sleep-mode engine per process), started by spawn: a forked child cannot use
        # CUDA once this process has initialised it ("Cannot re-initialize CUDA in forked subprocess"), as any
        # training process whose student is on the GPU has
        start = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
        saved = {k: os.environ.get(k) for k in start}
        os.environ.update(start)
        rng = vllm_engine._rng_state()
        try:
            self.llm = vllm.LLM(**kw)
        finally:
            vllm_engine._set_rng_state(rng)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.SamplingParams = vllm.SamplingParams
        self.sleeps = device.type == "cuda"
        self.awake = True
        self._sleep()

    def _sleep(self) -> None:
        if self.sleeps and self.awake:
            self.llm.sleep(level=1)  # weights to CPU memory (they are the checkpoint's: nothing is pushed), KV freed
            self.awake = False

    def _prompt_logprobs(self, seqs: list[list[int]], k: int) -> list[tuple]:
        if self.sleeps and not self.awake:
            self.llm.wake_up()
            self.awake = True
        try:
            params = self.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
            outputs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], sampling_params=params, use_tqdm=False)
        finally:
            self._sleep()
        return [(o.prompt_logprobs, o.prompt_token_ids) for o in outputs]


def make_teachers(cfg, inputs, device: torch.device, log=print):
    """The run's vLLM teacher (``teachers.TeacherSet`` of them with several): a server client where
    a url is set, else the colocated engine; scoring over the tokenizer's ids (the teacher's own with
    teacher.tokenizer=own: it then scores the completions re-tokenized by its tokenizer)."""
    from opdkit.models import tokenizer_ids
    from opdkit.pairs import teacher_urls
    from opdkit.teachers import TeacherSet

    own = cfg.teacher.tokenizer == "own"  # cross-tokenizer: the teacher scores its own ids (opdkit.xtok)
    n = tokenizer_ids(inputs.teacher_tokenizer if own else inputs.tokenizer)
    members = []
    for (_what, path), url in zip(inputs.teacher_paths.items(), teacher_urls(cfg).values()):
        members.append(ServerTeacher(url, path, n, cfg.teacher.timeout_s, log) if url
                       else EngineTeacher(cfg, path, n, device))
    return TeacherSet(tuple(t.name for t in cfg.teachers), members) if cfg.teachers else members[0]


# --- a checkpoint cut to the tokenizer's ids ------------------------------------------------------------


def vocab_cut(src: str | Path, dst: str | Path) -> dict:
    """Write to ``dst`` a copy of the HF checkpoint ``src`` whose input embedding and LM head hold
    only the tokenizer's ids (rows past them dropped; ``vocab_size`` set to that count), the other
    files copied: a teacher vLLM then scores over the ids the HF teacher scores over. Weights are read
    and written one tensor at a time per shard. Returns what it wrote."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from opdkit.engines.vllm import embedding_names
    from opdkit.models import check_model_dir, load_tokenizer, tokenizer_ids

    src, dst = Path(src), Path(dst)
    check_model_dir(src, "model")
    if dst.exists():
        raise FileExistsError(f"{dst} exists; vocab-cut writes a new directory")
    n = tokenizer_ids(load_tokenizer(src))
    config = AutoConfig.from_pretrained(str(src))
    with torch.device("meta"):
        names = embedding_names(AutoModelForCausalLM.from_config(config))
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{src}: vocab-cut reads safetensors weights; found none")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rows = None
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    index = {}
    for shard in shards:
        tensors = {}
        with safe_open(str(shard), framework="pt") as fh:
            meta = fh.metadata()
            for key in fh.keys():
                t = fh.get_tensor(key)
                if key in names:
                    rows = t.shape[0]
                    t = t[:n].contiguous()
                tensors[key] = t
                index[key] = shard.name
        save_file(tensors, str(tmp / shard.name), metadata=meta)
    if (src / "model.safetensors.index.json").is_file():
        idx = json.loads((src / "model.safetensors.index.json").read_text())
        idx["weight_map"] = index
        idx.get("metadata", {}).pop("total_size", None)
        (tmp / "model.safetensors.index.json").write_text(json.dumps(idx, indent=2))
    raw = json.loads((src / "config.json").read_text())
    (raw.get("text_config") or raw)["vocab_size"] = n
    (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tmp.rename(dst)
    return {"src": str(src), "dst": str(dst), "rows": rows, "ids": n, "cut": sorted(names)}

"""The ``Rollout`` every engine returns, the engine protocol, and padding / EOS helpers.

Prompts are left-padded (so every sequence's positions run contiguously from its first real
token), completions right-padded; each row is sampled with its own seed, derived from
``(seed, step, index)``, so a sample does not depend on what else is in the batch. Each engine
records the log-probability of each sampled token under the policy it was sampled from: the
model's logits over the tokenizer's ids, divided by the temperature, truncated to the top-p
nucleus (``engines.sampling``); the importance ratio of the update compares against it. An
engine asked for no log-probs (``sample(..., logprobs=False)``: nothing will read them) may leave
them out (``sampling_logp_B_T = None``; vLLM does, the HF engines record them anyway: they cost
nothing there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Rollout:
    """B = P*G sampled sequences (prompt-major: rows p*G .. p*G+G-1 share prompt p)."""

    prompt_ids_B_Sp: torch.Tensor  # left-padded prompt tokens
    prompt_mask_B_Sp: torch.Tensor  # 1 on real prompt tokens
    completion_ids_B_T: torch.Tensor  # sampled tokens, padded on the right with pad_id
    completion_mask_B_T: torch.Tensor  # 1 on sampled tokens up to and including the first EOS
    # log π (the sampling policy) of each sampled token (0 on padding); None: not recorded
    sampling_logp_B_T: torch.Tensor | None
    truncated_B: torch.Tensor  # bool: hit the token cap without emitting EOS
    prompt_index_B: torch.Tensor  # which prompt each row answers

    @property
    def n_tokens(self) -> int:
        return int(self.completion_mask_B_T.sum())


class RolloutEngine(Protocol):
    """What the training loop calls. ``reads_live_model``: True when ``sample`` runs the live
    (trainer's) model, so a sharded policy must be gathered for the whole ``sample``; False when
    the engine holds its own copy of the weights, refreshed by ``sync_weights`` (gathered only
    then)."""

    reads_live_model: bool

    def sample(
        self, prompts: list[list[int]], *, samples_per_prompt: int, seeds: list[int],
        temperature: float, top_p: float, max_new_tokens: int, logprobs: bool = True,
    ) -> Rollout: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...


def pad_and_eos(model, tokenizer) -> tuple[int, list[int]]:
    """The pad id (the tokenizer's, else its EOS) and the EOS ids (the model's generation config's,
    else the tokenizer's) that every engine stops at."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gc = getattr(model, "generation_config", None)
    eos = gc.eos_token_id if gc is not None and gc.eos_token_id is not None else tokenizer.eos_token_id
    return pad, list(eos) if isinstance(eos, (list, tuple)) else [eos]


def sampling_vocab(model, tokenizer) -> int | None:
    """The number of ids the engines may sample: ``len(tokenizer)`` when the model has more
    embedding rows (padding rows no token maps to), else None (every row is a token)."""
    rows = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else None
    n = len(tokenizer)
    if rows is None or n == rows:
        return None
    if n > rows:
        raise ValueError(f"the tokenizer has {n} ids but the model's output layer only {rows} rows: "
                         "they do not belong together")
    return n


def left_pad(seqs: list[list[int]], pad_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (ids_B_S, mask_B_S)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def completion_mask(ids_B_T: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real completion tokens (through the first EOS) and the truncated flag.

    Works where pad == eos: the mask comes from the position of the first EOS, not from
    comparing tokens with the pad id. Returns (mask_B_T float, truncated_B bool).
    """
    is_eos_B_T = torch.zeros_like(ids_B_T, dtype=torch.bool)
    for e in eos_ids:
        is_eos_B_T |= ids_B_T == e
    # eos_before_B_T: an EOS strictly before position t (cumulative count shifted right by one)
    seen_B_T = is_eos_B_T.long().cumsum(dim=1)
    eos_before_B_T = (seen_B_T - is_eos_B_T.long()) > 0
    mask_B_T = (~eos_before_B_T).float()
    truncated_B = ~is_eos_B_T.any(dim=1)
    return mask_B_T, truncated_B


def _right_pad_cat(tensors: list[torch.Tensor], value) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def _left_pad_cat(tensors: list[torch.Tensor], value) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value) for t in tensors])


def concat(parts, prompt_index_B: torch.Tensor, pad_id: int) -> Rollout:
    """One ``Rollout`` from per-chunk ``(prompt ids, prompt mask, completions, mask, logp, truncated)``."""
    ids, pm, comp, cm, logp, trunc = zip(*parts)
    return Rollout(
        prompt_ids_B_Sp=_left_pad_cat(list(ids), pad_id),
        prompt_mask_B_Sp=_left_pad_cat(list(pm), 0),
        completion_ids_B_T=_right_pad_cat(list(comp), pad_id),
        completion_mask_B_T=_right_pad_cat(list(cm), 0.0),
        sampling_logp_B_T=_right_pad_cat(list(logp), 0.0),
        truncated_B=torch.cat(list(trunc)),
        prompt_index_B=prompt_index_B.to(comp[0].device),
    )

"""Scoring sampled completions: geometry, hidden states, chunked log-probs, alignment check.

Geometry: a scored sequence is ``[left pads][prompt][completion][right pads]``. Position ids come
from the attention mask (``cumsum - 1``), so positions run contiguously from each sequence's
first real token, for the student and the teacher alike: exactly the positions the student had
while sampling with ``generate``. Logits at column ``c`` predict the token at ``c + 1``, so the
completion's T tokens are predicted by columns ``Sp-1 .. Sp+T-2``.

``build_right_padded_geometry`` is the other layout, for replaying the released OPSD collator
(``data.pad_side=right``): ``[prompt][pads][completion]``, the pads masked out of attention but
consuming positions, so every completion token is scored k positions after where it was sampled.

Log-probs over a large vocabulary are computed from final hidden states in chunks of positions,
under activation checkpointing when gradients are needed, so (B, T, V) fp32 logits never exist
at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from opdkit import packing
from opdkit.engines.sampling import policy_logits


@dataclass
class Geometry:
    input_ids_B_S: torch.Tensor
    attention_mask_B_S: torch.Tensor
    position_ids_B_S: torch.Tensor
    prompt_width: int  # Sp: completion token t sits at column Sp + t
    completion_len: int  # T

    def to(self, device) -> Geometry:
        """The same geometry on ``device`` (itself where it already is there)."""
        if self.input_ids_B_S.device == torch.device(device):
            return self
        return Geometry(self.input_ids_B_S.to(device), self.attention_mask_B_S.to(device),
                        self.position_ids_B_S.to(device), self.prompt_width, self.completion_len)


def build_geometry(prompt_ids_B_Sp, prompt_mask_B_Sp, completion_ids_B_T, completion_mask_B_T) -> Geometry:
    """Concatenate left-padded prompts and right-padded completions; positions from the mask."""
    input_ids_B_S = torch.cat([prompt_ids_B_Sp, completion_ids_B_T], dim=1)
    attention_mask_B_S = torch.cat([prompt_mask_B_Sp.long(), completion_mask_B_T.long()], dim=1)
    # Positions: 0 at the first real token, +1 per real token; pads get 0 (they are masked out).
    position_ids_B_S = (attention_mask_B_S.cumsum(dim=1) - 1).clamp_min(0)
    return Geometry(input_ids_B_S, attention_mask_B_S, position_ids_B_S,
                    prompt_ids_B_Sp.shape[1], completion_ids_B_T.shape[1])


def build_right_padded_geometry(prompt_ids_B_Sp, prompt_mask_B_Sp, completion_ids_B_T, completion_mask_B_T) -> Geometry:
    """The released OPSD collator's layout (``data.pad_side=right``), from left-padded prompts.

    Row b, with n_b real prompt tokens and k_b = Sp - n_b pads: ``[prompt (n_b)][pads (k_b)][completion]``.
    The pads are masked out of attention but every column keeps its index as position id
    (``arange(S)``, as a model called without ``position_ids`` numbers them), so completion token t
    sits at position Sp + t instead of n_b + t, where it was sampled: an offset of k_b. Completion
    token 0 is predicted by column Sp - 1, a pad wherever k_b > 0 (the released code slices the
    logits at the batch's prompt width). Same fields as ``build_geometry``; k_b = 0 rows match it.
    """
    B, Sp = prompt_ids_B_Sp.shape
    # each row's real tokens to the front: column j of the new row is column (j + k_b) mod Sp of the old
    k_B = Sp - prompt_mask_B_Sp.long().sum(dim=1)
    cols_B_Sp = (torch.arange(Sp, device=prompt_ids_B_Sp.device)[None, :] + k_B[:, None]) % Sp
    ids_B_Sp = prompt_ids_B_Sp.gather(1, cols_B_Sp)
    mask_B_Sp = prompt_mask_B_Sp.long().gather(1, cols_B_Sp)
    input_ids_B_S = torch.cat([ids_B_Sp, completion_ids_B_T], dim=1)
    attention_mask_B_S = torch.cat([mask_B_Sp, completion_mask_B_T.long()], dim=1)
    position_ids_B_S = torch.arange(input_ids_B_S.shape[1], device=input_ids_B_S.device)[None, :].expand(B, -1)
    return Geometry(input_ids_B_S, attention_mask_B_S, position_ids_B_S, Sp, completion_ids_B_T.shape[1])


class SharedVocabHead(torch.nn.Module):
    """A model's ``lm_head`` restricted to the first ``n`` ids: logits ``(..., n)``, so every
    log-softmax over them is renormalised over the shared vocabulary and padding rows never count.

    It calls the model's current head (looked up at each call, so a head that LoRA wrapped later
    is the one used) and slices its output, rather than ``F.linear`` on ``weight[:n]``, so that
    hooks on the head (FSDP2's unshard, peft) run as they do for the plain head.
    """

    def __init__(self, base, n: int):
        super().__init__()
        self._base, self.n = [base], n  # in a list: not a registered submodule (no cycle, no state)

    def forward(self, h):
        return self._base[0].lm_head(h)[..., : self.n]


_SHARED_HEAD = "_opdkit_shared_vocab_head"


def restrict_vocab(model, n: int) -> None:
    """Score ``model`` over ids ``0..n-1`` only (``unwrap`` returns the restricted head); a no-op
    when its head has exactly ``n`` rows. Kept on the model, unregistered (not in its state dict)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    rows = base.lm_head.weight.shape[0]
    if n > rows:
        raise ValueError(f"cannot restrict a head of {rows} rows to {n} ids")
    object.__setattr__(base, _SHARED_HEAD, SharedVocabHead(base, n) if n < rows else None)


def head_on(model, device) -> torch.nn.Module:
    """A frozen copy of ``model``'s scoring head (``unwrap``'s: restricted to the shared vocabulary
    after ``restrict_vocab``) on ``device``, made once and kept on the model (unregistered): the
    full-vocabulary losses make the teacher's logits where the student's are, from hidden states
    moved there (``teacher.device``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    copies = base.__dict__.setdefault(_HEAD_COPIES, {})
    device = torch.device(device)
    if device not in copies:
        lm = base.lm_head
        _, head = unwrap(model)
        n = head.n if isinstance(head, SharedVocabHead) else lm.weight.shape[0]
        copy = torch.nn.Linear(lm.weight.shape[1], n, bias=lm.bias is not None, device=device, dtype=lm.weight.dtype)
        with torch.no_grad():
            copy.weight.copy_(lm.weight[:n])
            if lm.bias is not None:
                copy.bias.copy_(lm.bias[:n])
        copies[device] = copy.requires_grad_(False)
    return copies[device]


_HEAD_COPIES = "_opdkit_head_copies"


def unwrap(model):
    """(decoder, head) of a causal LM, through a peft wrapper if there is one; the head is the
    ``lm_head``, or its restriction to the shared vocabulary after ``restrict_vocab``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    shared = base.__dict__.get(_SHARED_HEAD)
    return base.model, shared if shared is not None else base.lm_head


def completion_hidden(model, g: Geometry, unpadded: bool = False) -> torch.Tensor:
    """Final hidden states at the columns that predict the completion tokens: (B, T, H).

    ``unpadded``: run each row on its own with its pads removed (positions 0..n-1, no attention
    mask, so attention is plain causal and can use flash kernels); columns past a row's completion
    are zeros. Same values as the batched call up to kernel rounding; needs completions whose
    real tokens come first (as rollouts and references are laid out).
    """
    decoder, _ = unwrap(model)
    if unpadded and packing.varlen_available(g.input_ids_B_S.device) and packing.can_pack(decoder):  # one forward
        return packing.packed_hidden(decoder, g.input_ids_B_S, g.attention_mask_B_S, g.prompt_width, g.completion_len)
    if not unpadded:
        out = decoder(input_ids=g.input_ids_B_S, attention_mask=g.attention_mask_B_S,
                      position_ids=g.position_ids_B_S, use_cache=False)
        h_B_S_H = out.last_hidden_state
        return h_B_S_H[:, g.prompt_width - 1: g.prompt_width - 1 + g.completion_len]
    Sp, T = g.prompt_width, g.completion_len
    rows = []
    for b in range(g.input_ids_B_S.shape[0]):
        keep_S = g.attention_mask_B_S[b].bool()
        n_prompt, n_comp = int(keep_S[:Sp].sum()), int(keep_S[Sp:].sum())
        if not bool(keep_S[Sp:Sp + n_comp].all()):
            raise ValueError(f"row {b}: completion mask has a gap; unpadded scoring needs real tokens first")
        ids_1_S = g.input_ids_B_S[b, keep_S][None]
        pos_1_S = torch.arange(ids_1_S.shape[1], device=ids_1_S.device)[None]
        h_1_S_H = decoder(input_ids=ids_1_S, position_ids=pos_1_S, use_cache=False).last_hidden_state
        h_1_C_H = h_1_S_H[:, n_prompt - 1: n_prompt - 1 + n_comp]
        rows.append(torch.nn.functional.pad(h_1_C_H, (0, 0, 0, T - n_comp)))
    return torch.cat(rows)


def _chunk_token_logp(head, h_B_C_H, ids_B_C, temperature, top_p):
    logits_B_C_V = head(h_B_C_H).float()
    if ids_B_C.numel() and int(ids_B_C.max()) >= logits_B_C_V.shape[-1]:
        raise ValueError(f"token id {int(ids_B_C.max())} is outside the {logits_B_C_V.shape[-1]:,} ids scored (the "
                         "tokenizer's): a padding row of the embedding was sampled; samplers must not emit those ids")
    logits_B_C_V = policy_logits(logits_B_C_V, temperature, top_p)
    return logits_B_C_V.log_softmax(dim=-1).gather(-1, ids_B_C[..., None])[..., 0]


def token_logprobs(head, h_B_T_H: torch.Tensor, ids_B_T: torch.Tensor, chunk: int, temperature: float = 1.0,
                   top_p: float = 1.0) -> torch.Tensor:
    """log p(ids) under ``head(h)``, chunked over positions: (B, T) fp32. ``temperature`` /
    ``top_p``: of the policy π (``engines.sampling.policy_logits``) whose log-probs these are; the
    model's own distribution (the teacher's, and the scale of every teacher signal) at 1 / 1.
    An id outside the top-p nucleus gets -inf."""
    parts = []
    for s in range(0, h_B_T_H.shape[1], chunk):
        h, ids = h_B_T_H[:, s:s + chunk], ids_B_T[:, s:s + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk_token_logp, head, h, ids, temperature, top_p, use_reentrant=False))
        else:
            parts.append(_chunk_token_logp(head, h, ids, temperature, top_p))
    return torch.cat(parts, dim=1) if parts else h_B_T_H.new_zeros(ids_B_T.shape, dtype=torch.float)


def full_logprobs(head, h_B_T_H: torch.Tensor, chunk: int) -> torch.Tensor:
    """All-vocabulary log-probs (B, T, V) fp32, built chunk by chunk (no grad: teacher side)."""
    return torch.cat([head(h_B_T_H[:, s:s + chunk]).float().log_softmax(-1)
                      for s in range(0, h_B_T_H.shape[1], chunk)], dim=1)


def topk_logprobs(head, h_B_T_H: torch.Tensor, k: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher's top-k ids and log-probs per position: (B, T, K) each."""
    ids, vals = [], []
    for s in range(0, h_B_T_H.shape[1], chunk):
        logp_B_C_V = head(h_B_T_H[:, s:s + chunk]).float().log_softmax(-1)
        v, i = logp_B_C_V.topk(k, dim=-1)
        ids.append(i)
        vals.append(v)
    return torch.cat(ids, dim=1), torch.cat(vals, dim=1)


class AlignmentError(AssertionError):
    """Teacher/student scoring would not see the tokens where the student sampled them."""


def check_alignment(g: Geometry, completion_ids_B_T, completion_mask_B_T, prompt_mask_B_Sp) -> dict:
    """Assert the scored span is exactly the sampled completion, right after the prompt.

    Checks per row: the scored columns hold the sampled tokens; the last prompt column is a real
    token (no pad between prompt and completion); completion positions continue the prompt's
    (first completion position == number of real prompt tokens, +1 per token). Returns counts.
    """
    Sp, T = g.prompt_width, g.completion_len
    m = completion_mask_B_T.bool()
    if not torch.equal(g.input_ids_B_S[:, Sp:Sp + T][m], completion_ids_B_T[m]):
        raise AlignmentError("scored tokens differ from the sampled completion tokens")
    if not bool(prompt_mask_B_Sp[:, -1].bool().all()):
        bad = int((~prompt_mask_B_Sp[:, -1].bool()).nonzero()[0])
        raise AlignmentError(f"row {bad}: a pad sits between the prompt and the completion "
                             "(prompts must be left-padded)")
    n_prompt_B = prompt_mask_B_Sp.long().sum(dim=1)
    expected_B_T = n_prompt_B[:, None] + torch.arange(T, device=n_prompt_B.device)[None, :]
    got_B_T = g.position_ids_B_S[:, Sp:Sp + T]
    if not torch.equal(got_B_T[m], expected_B_T[m]):
        raise AlignmentError("completion position ids are not contiguous with the prompt's")
    return {"alignment_rows": int(m.shape[0]), "alignment_tokens": int(m.sum())}

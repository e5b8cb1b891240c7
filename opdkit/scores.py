"""What the teacher hands the loss for one micro-batch: ``TeacherScores``.

Made by ``step.teacher_context`` (an HF teacher), ``engines.vllm_teacher`` (a vLLM server),
``offline.Pool.score`` (a stored pool), ``teachers.merge`` (several teachers, laid out as one) and
``xtok_loss.to_student`` (a teacher with its own tokenizer, moved onto the student's tokens); read by
``step.chunk_loss``. Which fields are set follows ``loss_table.teacher_need``: ``token`` the sampled
tokens' log-probs, ``topk`` those and the top-K, ``full`` those and what makes the teacher's logits
over the vocabulary (``hidden_B_T_H`` and ``head``, or ``full_parts`` with several teachers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class TeacherScores:
    logp_B_T: torch.Tensor  # log p_T of each sampled token (B, T) fp32
    head: torch.nn.Module | None = None  # the teacher's LM head (with hidden_B_T_H: the full distribution)
    topk_ids_B_T_K: torch.Tensor | None = None  # topk: the teacher's top-K ids and their log-probs
    topk_logp_B_T_K: torch.Tensor | None = None
    hidden_B_T_H: torch.Tensor | None = None  # full: final hidden states at the completion positions
    # several teachers, full: (the rows' positions in the micro-batch, head, hidden states) per teacher
    full_parts: list | None = None
    # teacher.tokenizer=own (opdkit.xtok_loss): each token's span, its T_j, the span's length in student
    # tokens, whether the span is one-to-one, whether the row was respelled
    xtok_span_logp_B_T: torch.Tensor | None = None
    xtok_span_B_T: torch.Tensor | None = None
    xtok_len_B_T: torch.Tensor | None = None
    xtok_one_B_T: torch.Tensor | None = None
    xtok_respelled_B: torch.Tensor | None = None

    @property
    def cross_tokenizer(self) -> bool:
        """Whether these are a teacher's own-tokenizer scores moved onto the student's tokens."""
        return self.xtok_span_B_T is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-row tensors that are set, by field name (not the head, not ``full_parts``)."""
        return {f.name: v for f in dataclasses.fields(self)
                if torch.is_tensor(v := getattr(self, f.name))}

    def rows(self, rows) -> TeacherScores:
        """The scores of rows ``rows`` (a slice or an index tensor) only."""
        return dataclasses.replace(self, **{k: v[rows] for k, v in self.tensors().items()})

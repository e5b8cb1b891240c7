"""data.pad_side=right: the released OPSD collator's layout [prompt][pads][completion], the pads masked out
of attention but consuming RoPE positions; the alignment check's span part, which stays on there (the
released [OPSD align]'s), while the log-prob comparison is skipped; the offsets it records."""

import json
import subprocess

import pytest
import torch

from opdkit.config import config_from_dict
from opdkit.engines.base import Rollout, left_pad
from opdkit.opd import Batch, alignment_report, pad_offsets, student_geometry, teacher_geometry
from opdkit.scoring import (
    AlignmentError,
    build_geometry,
    build_right_padded_geometry,
    completion_hidden,
    token_logprobs,
    unwrap,
)

PAD = 0
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]  # widths 5, 2, 3: k = 0, 3, 2 pads in a batch of width 5
COMPLETIONS = [[21, 22, 23], [24, 25, PAD], [26, PAD, PAD]]
COMPLETION_MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]


def _tensors():
    p_ids, p_mask = left_pad(PROMPTS, PAD)  # the kit's rollouts hold left-padded prompts
    return p_ids, p_mask, torch.tensor(COMPLETIONS), torch.tensor(COMPLETION_MASK)


def test_right_padded_layout_written_out_by_hand():
    g = build_right_padded_geometry(*_tensors())
    width = max(map(len, PROMPTS))
    want_ids = [p + [PAD] * (width - len(p)) + c for p, c in zip(PROMPTS, COMPLETIONS)]
    want_mask = [[1] * len(p) + [0] * (width - len(p)) + m for p, m in zip(PROMPTS, COMPLETION_MASK)]
    assert g.input_ids_B_S.tolist() == want_ids
    assert g.attention_mask_B_S.tolist() == want_mask
    assert g.position_ids_B_S.tolist() == [list(range(width + 3))] * 3  # every column a position, pads too
    assert (g.prompt_width, g.completion_len) == (width, 3)
    # the longest prompt's row (k = 0) is laid out exactly as the left-padded geometry lays it out
    left = build_geometry(*_tensors())
    for field in ("input_ids_B_S", "attention_mask_B_S", "position_ids_B_S"):
        assert getattr(g, field)[0].tolist() == getattr(left, field)[0].tolist()


def test_scores_equal_the_released_forward_of_a_right_padded_batch(tiny_llama):
    """The released trainer calls the model on cat([right-padded prompts, completions]) with the attention mask
    and no position ids (the model numbers the columns 0..S-1), and reads the logits at the batch's prompt width
    - 1 onwards. The kit's right geometry must give those log-probs; left padding gives others wherever k > 0."""
    p_ids, p_mask, c_ids, c_mask = _tensors()
    width = p_ids.shape[1]
    ids = torch.tensor([p + [PAD] * (width - len(p)) + c for p, c in zip(PROMPTS, COMPLETIONS)])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) + m for p, m in zip(PROMPTS, COMPLETION_MASK)])
    with torch.no_grad():
        logits = tiny_llama(input_ids=ids, attention_mask=mask).logits.float()[:, width - 1: -1]
        released_B_T = logits.log_softmax(-1).gather(-1, c_ids[..., None])[..., 0]
        _, head = unwrap(tiny_llama)
        right = token_logprobs(head, completion_hidden(tiny_llama, build_right_padded_geometry(p_ids, p_mask, c_ids,
                                                                                               c_mask)),
                               c_ids, 8)
        left = token_logprobs(head, completion_hidden(tiny_llama, build_geometry(p_ids, p_mask, c_ids, c_mask)), c_ids,
                              8)
    m = c_mask.bool()
    assert torch.allclose(right[m], released_B_T[m], atol=1e-5)
    assert torch.allclose(left[0], right[0], atol=1e-5)  # k = 0: the same
    assert (left[1:] - right[1:])[m[1:]].abs().max() > 1e-3  # k > 0: the offset changes what the model says


def _batch(pad_side: str, teacher_prompts=None) -> Batch:
    p_ids, p_mask, c_ids, c_mask = _tensors()
    ro = Rollout(p_ids, p_mask, c_ids, c_mask.float(), torch.zeros(c_ids.shape), torch.zeros(3, dtype=torch.bool),
                 torch.arange(3))
    t_ids, t_mask = left_pad(teacher_prompts, PAD) if teacher_prompts else (p_ids, p_mask)
    return Batch(ro, t_ids, t_mask, pad_side)


def test_pad_offsets_are_the_pads_of_each_row():
    teacher = [p + [31] * 4 for p in PROMPTS[:2]] + [PROMPTS[2] + [32] * 10]  # longer teacher prompts (a solution)
    assert pad_offsets(_batch("left", teacher)) == {}
    k_student = [5 - len(p) for p in PROMPTS]
    k_teacher = [13 - len(p) for p in teacher]
    assert pad_offsets(_batch("right", teacher)) == pytest.approx({
        "pad_offset_student_mean": sum(k_student) / 3, "pad_offset_student_max": max(k_student),
        "pad_offset_teacher_mean": sum(k_teacher) / 3, "pad_offset_teacher_max": max(k_teacher)})
    b = _batch("right", teacher)
    assert teacher_geometry(b).input_ids_B_S.shape == (3, 13 + 3) and student_geometry(b).prompt_width == 5


def test_under_right_padding_the_span_check_stays_on_and_the_logprob_comparison_is_skipped(tiny_llama):
    """The released [OPSD align]: the supervised span is exactly the sampled completion, no pad between the
    prompt block and it. It passes on the released layout and fails on a span that is not the completion."""
    cfg = config_from_dict({}, ["data.pad_side=right"])
    settings = dict(rollout=cfg.rollout, runtime=cfg.runtime, teacher_source=cfg.teacher.source)
    report = alignment_report(cfg.loss, _batch("right"), tiny_llama, torch.float32, **settings)
    assert report["alignment_tokens"] == 6 and report["logprob_check"].startswith("skipped: data.pad_side=right")
    assert not any(k.endswith("_abs_dlogp") for k in report)
    bad = _batch("right")
    bad.rollout.completion_mask_B_T[2] = torch.tensor([1.0, 0.0, 1.0])  # a pad inside row 2's supervised span
    with pytest.raises(AlignmentError, match="has a gap"):
        alignment_report(cfg.loss, bad, tiny_llama, torch.float32, **settings)
    from opdkit.opd import check_right_padded_span

    g = student_geometry(_batch("right"))
    g.input_ids_B_S[1, 5] = 99  # the scored column holds another token than the sampled one
    with pytest.raises(AlignmentError, match="differ from the sampled completion"):
        check_right_padded_span(g, torch.tensor(COMPLETIONS), torch.tensor(COMPLETION_MASK), _tensors()[1])
    g = student_geometry(_batch("right"))
    g.position_ids_B_S = g.position_ids_B_S.clone()
    g.position_ids_B_S[:, 5:] += 1  # a pad column between the prompt block and the completion
    with pytest.raises(AlignmentError, match="a pad sits between the prompt block and the completion"):
        check_right_padded_span(g, torch.tensor(COMPLETIONS), torch.tensor(COMPLETION_MASK), _tensors()[1])


TINY = ["-S", "rollout.prompts_per_step=4", "-S", "rollout.samples_per_prompt=1", "-S", "rollout.max_new_tokens=8",
        "-S", "budget.max_steps=2", "-S", "budget.max_wall_time_s=0", "-S", "runtime.threads=1",
        "-S", "optim.schedule=constant", "-S", "publish.every_steps=2", "-S", "data.pad_side=right"]


def _train(tmp_path, capsys, monkeypatch, *extra):
    """``opdkit train`` by the CLI's own entry point (``python -m opdkit`` is ``raise SystemExit(main())``) in this
    process, in ``tmp_path``: a fresh interpreter would spend seconds importing torch."""
    from opdkit.cli import main

    argv = ["train", "--out", str(tmp_path / "out"), "-p", "none", "--quiet", *TINY, *extra]
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.chdir(tmp_path)
        code = main(argv)
    said = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, said.out, said.err)


def test_training_with_right_padding_checks_the_span_and_records_the_offsets(tmp_path, capsys, monkeypatch):
    proc = _train(tmp_path, capsys, monkeypatch)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert rows[0]["alignment"]["logprob_check"].startswith("skipped") and rows[0]["alignment"]["alignment_tokens"] > 0
    for r in rows:  # the embedded prompts differ in length: some rows carry pads, the longest none
        assert 0 < r["pad_offset_student_mean"] < r["pad_offset_student_max"]
        assert r["pad_offset_teacher_mean"] == r["pad_offset_student_mean"]  # teacher.source=model: the same prompts


def test_right_padding_refuses_unpadded_rows():
    from opdkit.setup import RunError, check_params

    with pytest.raises(RunError, match="unpadded_rows"):
        check_params(config_from_dict({}, ["data.pad_side=right", "runtime.unpadded_rows=true", "budget.max_steps=1"]))

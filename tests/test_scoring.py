import pytest
import torch

from opdkit import losses
from opdkit.engines.base import left_pad
from opdkit.engines.hf import HFEngine
from opdkit.scoring import (
    AlignmentError,
    build_geometry,
    check_alignment,
    completion_hidden,
    full_logprobs,
    token_logprobs,
    topk_logprobs,
    unwrap,
)


@pytest.fixture(scope="module")
def rollout(tiny_llama, tok):
    ids = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4."]]
    return HFEngine(tiny_llama, tok).sample(ids, samples_per_prompt=2, seeds=[1, 2, 3, 4], temperature=1.0,
                                            top_p=1.0, max_new_tokens=10)


def test_geometry_positions_are_contiguous_from_first_real_token():
    p_ids, p_mask = left_pad([[1, 5, 6], [1, 7]], pad_id=0)
    c_ids, c_mask = torch.tensor([[8, 2, 0], [9, 9, 2]]), torch.tensor([[1, 1, 0], [1, 1, 1]])
    g = build_geometry(p_ids, p_mask, c_ids, c_mask)
    assert g.position_ids_B_S.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 1, 2, 3, 4]]
    assert check_alignment(g, c_ids, c_mask, p_mask)["alignment_tokens"] == 5


def test_alignment_check_rejects_a_right_padded_prompt():
    p_ids, p_mask = torch.tensor([[1, 5, 0]]), torch.tensor([[1, 1, 0]])  # pad between prompt and completion
    c_ids, c_mask = torch.tensor([[8, 2]]), torch.tensor([[1, 1]])
    with pytest.raises(AlignmentError, match="pad sits between"):
        check_alignment(build_geometry(p_ids, p_mask, c_ids, c_mask), c_ids, c_mask, p_mask)


def test_teacher_equal_student_gives_zero_advantage_whatever_the_padding(tiny_llama, tok, rollout):
    """Scored with extra left pads (positions from the mask) the same model gives the same
    log-probs, so every k1 advantage is 0 up to float error."""
    ro = rollout
    g = build_geometry(ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp, ro.completion_ids_B_T, ro.completion_mask_B_T)
    extra = 5
    pad = torch.full((ro.prompt_ids_B_Sp.shape[0], extra), tok.pad_token_id)
    g_pad = build_geometry(torch.cat([pad, ro.prompt_ids_B_Sp], 1),
                           torch.cat([torch.zeros_like(pad), ro.prompt_mask_B_Sp], 1), ro.completion_ids_B_T,
                           ro.completion_mask_B_T)
    with torch.no_grad():  # the sampled tokens' log-probs, as the teacher scores them (step.teacher_context)
        s, t = (token_logprobs(unwrap(tiny_llama)[1], completion_hidden(tiny_llama, geom), ro.completion_ids_B_T, 8)
                for geom in (g, g_pad))
    m = ro.completion_mask_B_T
    assert ((t - s) * m).abs().max() < 1e-5
    logp = s.clone().requires_grad_(True)
    loss, metrics = losses.k1_loss(logp, s, s, m, float(m.sum()), 0.2)
    loss.backward()
    assert metrics["advantage_mean"] == 0.0 and logp.grad.abs().max() == 0


def test_chunked_scoring_matches_unchunked(tiny_llama, rollout):
    ro = rollout
    g = build_geometry(ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp, ro.completion_ids_B_T, ro.completion_mask_B_T)
    _, head = unwrap(tiny_llama)
    with torch.no_grad():
        h = completion_hidden(tiny_llama, g)
        full = tiny_llama(input_ids=g.input_ids_B_S, attention_mask=g.attention_mask_B_S,
                          position_ids=g.position_ids_B_S).logits.float().log_softmax(-1)
    ref = full[:, g.prompt_width - 1: g.prompt_width - 1 + g.completion_len]
    assert torch.allclose(full_logprobs(head, h, chunk=3), ref, atol=1e-5)
    tok_ref = ref.gather(-1, ro.completion_ids_B_T[..., None])[..., 0]
    assert torch.allclose(token_logprobs(head, h, ro.completion_ids_B_T, chunk=4), tok_ref, atol=1e-5)
    ids, vals = topk_logprobs(head, h, 3, chunk=2)
    assert torch.equal(ids, ref.topk(3, -1).indices) and torch.allclose(vals, ref.topk(3, -1).values, atol=1e-5)


def test_unpadded_rows_match_each_sequence_alone_and_run_attention_without_a_mask(tiny_llama, tok, monkeypatch):
    """``unpadded=True`` scores each row trimmed of its pads: the log-probs equal an independent
    reference (the row's real tokens alone through the full model, default positions) and the
    batched padded call; attention gets no mask (causal kernels). Completions of unequal length."""
    p_ids, p_mask = left_pad([tok("Compute 47+5-29.").input_ids, tok("Compute 3+4.").input_ids], tok.pad_token_id)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    c_ids = torch.tensor([[5, 6, 7, 8, eos], [9, 10, eos, pad, pad]])
    c_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    g = build_geometry(p_ids, p_mask, c_ids, c_mask)
    _, head = unwrap(tiny_llama)
    masks = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **k):
        masks.append((k.get("attn_mask"), k.get("is_causal")))
        return real_sdpa(*a, **k)

    with torch.no_grad():
        batched = token_logprobs(head, completion_hidden(tiny_llama, g), c_ids, chunk=3)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        unpadded = token_logprobs(head, completion_hidden(tiny_llama, g, unpadded=True), c_ids, chunk=3)
        monkeypatch.undo()
        for b in range(2):
            n_p, n_c = int(p_mask[b].sum()), int(c_mask[b].sum())
            seq = torch.cat([p_ids[b, -n_p:], c_ids[b, :n_c]])[None]
            ref = tiny_llama(input_ids=seq).logits.float().log_softmax(-1)[0, n_p - 1: n_p - 1 + n_c]
            ref = ref.gather(-1, c_ids[b, :n_c, None])[:, 0]
            assert torch.allclose(unpadded[b, :n_c], ref, atol=1e-5)
    m = c_mask.bool()
    assert torch.allclose(unpadded[m], batched[m], atol=1e-5)
    assert tiny_llama.config._attn_implementation == "sdpa" and len(masks) == 2 * 2  # rows x layers
    assert all(mask is None for mask, _ in masks)


@pytest.mark.parametrize("loss", ["k1", "rkl"])
def test_unpadded_rows_give_the_batched_gradients(tiny_llama, tok, rollout, loss):
    """One OPD step's loss and gradients with ``runtime.unpadded_rows`` equal the batched ones."""
    import contextlib
    import copy

    from opdkit import opd, step as opd_step
    from opdkit.config import load_config

    teacher = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = opd.Batch(rollout, rollout.prompt_ids_B_Sp, rollout.prompt_mask_B_Sp)
    grads, metrics = [], []
    for unpadded in (False, True):
        cfg = load_config(None, [f"loss.name={loss}", f"runtime.unpadded_rows={str(unpadded).lower()}",
                                 "runtime.logprob_chunk=4", "optim.micro_batch=3"])
        student = copy.deepcopy(tiny_llama).train()
        kw = {"rollout": cfg.rollout, "runtime": cfg.runtime, "micro_batch": cfg.optim.micro_batch}
        ctx = opd_step.score_batch(cfg.loss, teacher, batch, contextlib.nullcontext, **kw)
        metrics.append(opd_step.micro_losses(cfg.loss, student, batch, ctx, contextlib.nullcontext, **kw))
        grads.append(torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]))
    assert abs(metrics[0]["loss"] - metrics[1]["loss"]) < 1e-6 and abs(metrics[0]["kl"] - metrics[1]["kl"]) < 1e-6
    assert grads[0].abs().max() > 0 and torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)

"""opdkit.studies: layouts by hand, padding offsets on a tiny random RoPE Llama, clip statistics
against plain references, and one end-to-end run of each study on the embedded models."""

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from opdkit import losses
from opdkit.config import load_config
from opdkit.engines.base import Rollout
from opdkit.studies import (
    clipped_mass_stats,
    clipped_mass_study,
    entry_clip_stats,
    jsonable,
    kl_between,
    left_pad_geometry,
    padding_offsets,
    padding_study,
    reference_geometry,
    right_pad_geometry,
    token_kl,
)

PAD = 0


def _two_rows():
    """Row 0: one left pad, prompt 5 6, completion 1 2; row 1: prompt 7 8 9, completion 3 then a pad."""
    prompt_ids_B_Sp = torch.tensor([[PAD, 5, 6], [7, 8, 9]])
    prompt_mask_B_Sp = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids_B_T = torch.tensor([[1, 2], [3, PAD]])
    completion_mask_B_T = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    return prompt_ids_B_Sp, prompt_mask_B_Sp, completion_ids_B_T, completion_mask_B_T


# ----------------------------------------------------------------------------- layouts by hand


def test_right_pad_geometry_by_hand():
    sg = right_pad_geometry(*_two_rows(), k=2, pad_id=PAD)
    g = sg.g
    assert g.input_ids_B_S.tolist() == [[PAD, 5, 6, PAD, PAD, 1, 2], [7, 8, 9, PAD, PAD, 3, PAD]]
    assert g.attention_mask_B_S.tolist() == [[0, 1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 1, 0]]
    # positions run on over the gap: the completion starts at (real prompt tokens) + k
    assert g.position_ids_B_S.tolist() == [[0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 5]]
    assert g.prompt_width == 5 and g.completion_len == 2
    # token 0 is predicted by the last prompt column, token 1 by the column of token 0
    assert sg.cols_T.tolist() == [2, 5]


def test_left_pad_geometry_by_hand():
    sg = left_pad_geometry(*_two_rows(), k=2, pad_id=PAD)
    g = sg.g
    assert g.input_ids_B_S.tolist() == [[PAD, PAD, PAD, 5, 6, 1, 2], [PAD, PAD, 7, 8, 9, 3, PAD]]
    assert g.attention_mask_B_S.tolist() == [[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0]]
    assert g.position_ids_B_S.tolist() == [[0, 0, 0, 0, 1, 2, 3], [0, 0, 0, 1, 2, 3, 3]]
    assert sg.cols_T.tolist() == [4, 5]


def test_k0_layouts_are_the_reference():
    ref = reference_geometry(*_two_rows())
    assert ref.g.position_ids_B_S.tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 3]]
    assert ref.cols_T.tolist() == [2, 3]
    for make in (right_pad_geometry, left_pad_geometry):
        sg = make(*_two_rows(), k=0, pad_id=PAD)
        for name in ("input_ids_B_S", "attention_mask_B_S", "position_ids_B_S"):
            assert torch.equal(getattr(sg.g, name), getattr(ref.g, name)), (make.__name__, name)
        assert torch.equal(sg.cols_T, ref.cols_T)


def test_kl_between_matches_a_plain_reference():
    g = torch.Generator().manual_seed(0)
    a_B_T_V = torch.randn(2, 3, 5, generator=g).log_softmax(-1)
    b_B_T_V = torch.randn(2, 3, 5, generator=g).log_softmax(-1)
    mask_B_T = torch.tensor([[1, 1, 0], [1, 0, 0]])
    want = [sum(float(a_B_T_V[i, t, v].exp() * (a_B_T_V[i, t, v] - b_B_T_V[i, t, v])) for v in range(5))
            for i, t in [(0, 0), (0, 1), (1, 0)]]
    assert token_kl(a_B_T_V, b_B_T_V, mask_B_T).tolist() == pytest.approx(want, abs=1e-6)
    assert kl_between(a_B_T_V, b_B_T_V, mask_B_T) == pytest.approx(sum(want) / 3, abs=1e-6)
    assert kl_between(a_B_T_V, a_B_T_V, mask_B_T) == 0.0


# ----------------------------------------------------------------------------- tiny random Llama (RoPE)


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=128, initializer_range=0.2, pad_token_id=PAD)
    return LlamaForCausalLM(cfg).eval()


def _hand_rollout():
    """3 rows with different prompt lengths (left-padded) and one short completion."""
    g = torch.Generator().manual_seed(1)
    B, Sp, T = 3, 6, 5
    prompt_ids_B_Sp = torch.randint(1, 16, (B, Sp), generator=g)
    prompt_mask_B_Sp = torch.ones(B, Sp, dtype=torch.long)
    prompt_mask_B_Sp[1, :2] = 0
    prompt_mask_B_Sp[2, :4] = 0
    prompt_ids_B_Sp[prompt_mask_B_Sp == 0] = PAD
    completion_ids_B_T = torch.randint(1, 16, (B, T), generator=g)
    completion_mask_B_T = torch.ones(B, T)
    completion_mask_B_T[0, 3:] = 0
    completion_ids_B_T[completion_mask_B_T == 0] = PAD
    return Rollout(prompt_ids_B_Sp, prompt_mask_B_Sp, completion_ids_B_T, completion_mask_B_T, torch.zeros(B, T),
                   torch.zeros(B, dtype=torch.bool), torch.arange(B))


def test_padding_offsets_on_a_tiny_rope_llama():
    ks = [0, 1, 3, 8]
    res = padding_offsets({"teacher": _tiny_llama(0), "student": _tiny_llama(1)}, _hand_rollout(), PAD, ks, chunk=2048)
    assert res["n_tokens"] == 13
    for who in ("teacher", "student"):
        right, left = res[f"kl_right_{who}"], res[f"kl_left_{who}"]
        assert right[0] == 0.0 and res[f"max_dlogp_right_{who}"][0] == 0.0  # k = 0: the same tensors, exactly
        assert all(abs(v) < 1e-5 for v in left), left  # correct positions: float noise only
        assert all(v < 1e-4 for v in res[f"max_dlogp_left_{who}"])
        assert all(v > 1e-4 for v in right[1:]), right  # positions consumed by pads: a real shift
    assert res["signal_kl"] > 1e-3  # two different random models


def _head_positions(model) -> list[int]:
    """Record rows x positions of every LM-head call (the (rows, C, V) logits it makes)."""
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.shape[:-1].numel()))
    return seen


def test_padding_offsets_do_not_depend_on_chunking():
    """runtime.logprob_chunk below T (the rollout's T = 5): logits are made a few positions of one
    row at a time, never (rows, T, V), and the numbers are the same as with whole rows."""
    models = {"teacher": _tiny_llama(0), "student": _tiny_llama(1)}
    whole = padding_offsets(models, _hand_rollout(), PAD, [0, 2], chunk=2048)
    seen = _head_positions(models["teacher"])
    for chunk in (1, 2):
        seen.clear()
        part = padding_offsets(models, _hand_rollout(), PAD, [0, 2], chunk=chunk)
        assert seen and max(seen) <= chunk
        for key, vals in whole.items():
            assert part[key] == pytest.approx(vals, abs=1e-6), (chunk, key)


def test_clipped_mass_scoring_holds_at_most_a_chunk_of_logits():
    from opdkit.studies.clipped_mass import score_chunks

    student, teacher, ro = _tiny_llama(1), _tiny_llama(0), _hand_rollout()
    n = float(ro.completion_mask_B_T.sum())
    whole = clipped_mass_stats(score_chunks(student, teacher, ro, 2048), n, TAUS, BINS)
    seen = _head_positions(teacher)
    blocks = list(score_chunks(student, teacher, ro, 2))  # T = 5 > 2
    assert max(seen) <= 2 and max(s.shape[:2].numel() for s, _, _ in blocks) <= 2
    part = clipped_mass_stats(iter(blocks), n, TAUS, BINS)
    for key in ("clipped_mass", "argmax_clipped_rate", "grad_cosine", "kl_mean", "fkl_mean", "n_positions"):
        assert part[key] == pytest.approx(whole[key], abs=1e-6), key


# ----------------------------------------------------------------------------- clip statistics


def _clip_inputs(seed=0, B=3, T=4, V=9):
    g = torch.Generator().manual_seed(seed)
    student_logits_B_T_V = 2.0 * torch.randn(B, T, V, generator=g)
    teacher_logp_B_T_V = (2.0 * torch.randn(B, T, V, generator=g)).log_softmax(-1)
    mask_B_T = torch.ones(B, T)
    mask_B_T[0, 2:] = 0
    return student_logits_B_T_V, teacher_logp_B_T_V, mask_B_T


TAUS = [0.0, 0.01, 0.1, 1.0, math.inf]
BINS = [0.0, 0.1, 1.0, math.inf]


def test_entry_clip_stats_extremes_against_a_plain_reference():
    s_logits, t_logp, _ = _clip_inputs()
    s_logp = s_logits.log_softmax(-1)
    p_T = t_logp.exp()
    positive_B_T_V = p_T * (t_logp - s_logp) > 0
    mass0_B_T, arg0_B_T = entry_clip_stats(s_logp, t_logp, 0.0)
    assert torch.allclose(mass0_B_T, (p_T * positive_B_T_V).sum(-1), atol=1e-6)  # tau = 0: every positive entry
    assert torch.equal(arg0_B_T, positive_B_T_V.gather(-1, t_logp.argmax(-1, keepdim=True))[..., 0])
    mass_inf_B_T, arg_inf_B_T = entry_clip_stats(s_logp, t_logp, math.inf)
    assert float(mass_inf_B_T.abs().max()) == 0.0 and not bool(arg_inf_B_T.any())


def test_clipped_mass_stats_numbers():
    s_logits, t_logp, mask_B_T = _clip_inputs()
    n = float(mask_B_T.sum())
    res = clipped_mass_stats([(s_logits, t_logp, mask_B_T)], n, TAUS, BINS)
    assert res["n_positions"] == 10
    i_inf, i_0 = TAUS.index(math.inf), TAUS.index(0.0)
    assert res["clipped_mass"][i_inf] == 0.0 and res["argmax_clipped_rate"][i_inf] == 0.0
    assert res["grad_cosine"][i_inf] == pytest.approx(1.0, abs=1e-9)
    assert res["token_clip"]["grad_cosine"][i_inf] == pytest.approx(1.0, abs=1e-9)
    assert res["token_clip"]["clipped_frac"][i_0] == 1.0  # every position has KL > 0
    assert math.isnan(res["token_clip"]["grad_cosine"][i_0])  # a token clip at 0 leaves no gradient
    # tau = 0: the teacher mass on entries with a positive summand, averaged over positions
    s_logp = s_logits.log_softmax(-1)
    pos_mass_B_T = (t_logp.exp() * ((t_logp.exp() * (t_logp - s_logp)) > 0)).sum(-1)
    assert res["clipped_mass"][i_0] == pytest.approx(float(pos_mass_B_T[mask_B_T.bool()].mean()), abs=1e-6)
    # non-increasing in tau (TAUS is sorted); the same numbers as the loss's own metric
    assert all(a >= b for a, b in zip(res["clipped_mass"], res["clipped_mass"][1:]))
    for tau, mass in zip(TAUS, res["clipped_mass"]):
        _, m = losses.fkl_loss(s_logits, t_logp, mask_B_T, n, clip="entry", tau=tau)
        assert mass == pytest.approx(m["clipped_mass"], abs=1e-6)
    # binned masses are the per-bin means: with the bin counts they give back the overall mean
    for row, mass in zip(res["clipped_mass_by_kl"], res["clipped_mass"]):
        total = sum(c * v for c, v in zip(res["kl_bin_counts"], row) if c)
        assert total / sum(res["kl_bin_counts"]) == pytest.approx(mass, abs=1e-6)


def test_grad_cosine_against_a_plain_reference():
    s_logits, t_logp, mask_B_T = _clip_inputs()
    tau = 0.05
    res = clipped_mass_stats([(s_logits, t_logp, mask_B_T)], float(mask_B_T.sum()), [tau], BINS)
    x = s_logits.clone().requires_grad_(True)
    terms_B_T_V = t_logp.exp() * (t_logp - x.log_softmax(-1))
    m = mask_B_T[..., None]
    (g_none,) = torch.autograd.grad((terms_B_T_V * m).sum(), x, retain_graph=True)
    (g_clip,) = torch.autograd.grad((torch.clamp(terms_B_T_V, max=tau) * m).sum(), x)
    want = float(torch.nn.functional.cosine_similarity(g_clip.flatten(), g_none.flatten(), dim=0))
    assert res["grad_cosine"][0] == pytest.approx(want, abs=1e-5)


def test_clipped_mass_stats_do_not_depend_on_chunking():
    s_logits, t_logp, mask_B_T = _clip_inputs()
    n = float(mask_B_T.sum())
    whole = clipped_mass_stats([(s_logits, t_logp, mask_B_T)], n, TAUS, BINS)
    rows = ((s_logits[i:i + 1], t_logp[i:i + 1], mask_B_T[i:i + 1]) for i in range(3))
    parts = clipped_mass_stats(rows, n, TAUS, BINS)
    for key in ("clipped_mass", "argmax_clipped_rate", "grad_cosine", "grad_norm_ratio", "kl_mean", "kl_bin_counts"):
        assert parts[key] == pytest.approx(whole[key], abs=1e-6), key
    for key in ("clipped_frac", "grad_cosine"):
        assert parts["token_clip"][key] == pytest.approx(whole["token_clip"][key], abs=1e-6, nan_ok=True), key


def test_jsonable_writes_strict_json():
    out = jsonable({"tau": (0.0, math.inf), "x": [math.nan, 1], "y": {"z": -math.inf}})
    assert out == {"tau": [0.0, "inf"], "x": [None, 1], "y": {"z": "-inf"}}
    json.dumps(out, allow_nan=False)


# ----------------------------------------------------------------------------- end to end (embedded models)


def _tiny_cfg(*extra):
    # one thread: with two on a busy 2-core machine, generate's many small ops slow down ~100x
    return load_config(None, ["studies.n_prompts=4", "studies.samples_per_prompt=1", "rollout.max_new_tokens=48",
                              "runtime.threads=1", *extra])


def test_padding_study_end_to_end(tmp_path):
    res = padding_study(_tiny_cfg("studies.padding_k=[0, 4]"), tmp_path, progress=False)
    written = json.loads((tmp_path / "padding.json").read_text())
    assert written == res
    assert res["k"] == [0, 4]
    for key in ("kl_right", "kl_left", "kl_right_student", "kl_left_student", "max_dlogp_right", "max_dlogp_left"):
        assert len(res[key]) == 2, key
    assert res["kl_right"][0] == 0.0 and res["kl_right_student"][0] == 0.0
    assert all(abs(v) < 1e-5 for v in res["kl_left"] + res["kl_left_student"])
    assert res["kl_right"][1] > 1e-4  # the embedded models use RoPE: shifted positions change the scores
    assert res["signal_kl"] > 0 and res["n_sequences"] == 4
    assert res["alignment"]["passed"] is True and res["alignment"]["alignment_rows"] == 4
    assert "pad sits between" in res["right_pad_alignment_error"]
    assert (tmp_path / "padding_kl.png").stat().st_size > 0


def test_clipped_mass_study_end_to_end(tmp_path):
    res = clipped_mass_study(_tiny_cfg("studies.clip_tau=[0, 0.01, 0.5, inf]"), tmp_path, progress=False)
    assert json.loads((tmp_path / "clipped_mass.json").read_text()) == res
    assert res["tau"] == [0.0, 0.01, 0.5, "inf"]
    for key in ("clipped_mass", "argmax_clipped_rate", "grad_cosine", "clipped_mass_by_kl"):
        assert len(res[key]) == 4, key
    n_bins = len(res["kl_bins"]) - 1
    assert all(len(row) == n_bins for row in res["clipped_mass_by_kl"])
    assert set(res["token_clip"]) >= {"tau", "clipped_frac", "grad_cosine"}
    mass = res["clipped_mass"]
    assert all(a >= b for a, b in zip(mass, mass[1:])) and mass[-1] == 0.0 and mass[0] > 0
    assert res["grad_cosine"][-1] == pytest.approx(1.0, abs=1e-6)
    assert res["kl_mean"] > 0 and set(res["kl_quantiles"]) == {"p10", "p25", "p50", "p75", "p90", "p99"}
    for name in ("clipped_mass_vs_tau.png", "clipped_mass_by_kl.png", "grad_cosine_vs_tau.png"):
        assert (tmp_path / name).stat().st_size > 0

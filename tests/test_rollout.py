import pytest
import torch

from generate_reference import generate_reference
from opdkit.embedded import asset
from opdkit.engines.base import completion_mask, left_pad
from opdkit.engines.hf import HFEngine
from opdkit.engines.sampling import SeededSampler, sample_seed, top_p_filter
from opdkit.scoring import build_geometry, completion_hidden, token_logprobs, unwrap

PROMPTS = ["Compute 47+5-29.", "Compute 3+4.", "Compute 88-80+17-5."]


def test_completion_mask_pad_equals_eos():
    eos = 2
    ids = torch.tensor([[5, 6, 2, 2, 2], [5, 2, 7, 2, 2], [5, 6, 7, 8, 9]])
    mask, trunc = completion_mask(ids, [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert trunc.tolist() == [False, False, True]


def test_left_pad():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    assert torch.isfinite(top_p_filter(logits, 0.5))[0].tolist() == [True, False, False, False]
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_seeded_sampler_matches_the_tempered_distribution():
    """Gumbel-max with per-row generators draws from softmax(logits / T)."""
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0])
    T, n = 0.8, 4000
    sampler = SeededSampler([sample_seed(0, 0, i) for i in range(n)], T, 1.0, prompt_width=1, device="cpu")
    picks = sampler(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, 4).clone()).argmax(-1)
    freq = torch.bincount(picks, minlength=4).float() / n
    assert torch.allclose(freq, (logits / T).softmax(-1), atol=0.03), freq


def _rollout(model, tok, prompts, seeds, G=1, **kw):
    eng = HFEngine(model, tok)
    ids = [tok(p).input_ids for p in prompts]
    return eng.sample(ids, samples_per_prompt=G, seeds=seeds, temperature=kw.get("temperature", 1.0),
                      top_p=kw.get("top_p", 1.0), max_new_tokens=kw.get("max_new_tokens", 12))


def test_samples_do_not_depend_on_the_batch(tiny_llama, tok):
    seeds = [sample_seed(7, 3, i) for i in range(len(PROMPTS))]
    together = _rollout(tiny_llama, tok, PROMPTS, seeds)
    for i, p in enumerate(PROMPTS):
        alone = _rollout(tiny_llama, tok, [p], [seeds[i]])
        n = int(alone.completion_mask_B_T.sum())
        assert together.completion_ids_B_T[i, :n].tolist() == alone.completion_ids_B_T[0, :n].tolist()
    again = _rollout(tiny_llama, tok, PROMPTS, seeds)
    assert torch.equal(again.completion_ids_B_T, together.completion_ids_B_T)


def test_sampling_logprobs_match_recomputed_on_contiguous_positions(tiny_llama, tok):
    ro = _rollout(tiny_llama, tok, PROMPTS, [1, 2, 3, 4, 5, 6], G=2)
    assert ro.completion_ids_B_T.shape[0] == 6 and ro.prompt_index_B.tolist() == [0, 0, 1, 1, 2, 2]
    g = build_geometry(ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp, ro.completion_ids_B_T, ro.completion_mask_B_T)
    _, head = unwrap(tiny_llama)
    with torch.no_grad():
        logp = token_logprobs(head, completion_hidden(tiny_llama, g), ro.completion_ids_B_T, chunk=5)
    m = ro.completion_mask_B_T.bool()
    assert (logp - ro.sampling_logp_B_T)[m].abs().max() < 1e-5
    assert (ro.sampling_logp_B_T[~m] == 0).all()


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.6, 0.95)])
def test_the_decode_loop_samples_what_generate_samples_bit_for_bit(tok, temperature, top_p):
    """The engine's decode loop against transformers' generate with the same sampler, on the shipped
    student and teacher: the same tokens and the same log-probs, bit for bit (prompts of unequal
    lengths; every row stopping by itself, or the token cap); in chunks of 3 rows, the same tokens."""
    from opdkit.models import load_model

    prompts = [tok(p).input_ids for p in PROMPTS + ["Compute 9-8.", "Compute 123+456-789+10."]]
    rows = [p for p in prompts for _ in range(2)]
    seeds = [sample_seed(3, 1, i) for i in range(len(rows))]
    for role, caps in (("student", (64, 5)), ("teacher", (64,))):
        model = load_model(asset(role), torch.device("cpu"))
        eng = HFEngine(model, tok, static_cache=False)
        for cap in caps:
            ids, mask, ref_ids, ref_logp = generate_reference(model, tok, rows, seeds, temperature, top_p, cap)
            got_ids, got_logp = eng._hf_generate(ids, mask, seeds, temperature, top_p, cap)
            assert torch.equal(got_ids, ref_ids) and torch.equal(got_logp, ref_logp), (role, cap)
            assert ref_ids.shape[1] == cap if cap == 5 else ref_ids.shape[1] < cap  # capped / every row stopped
    ids, mask, ref_ids, ref_logp = generate_reference(model, tok, rows, seeds, temperature, top_p, 64)
    chunked = HFEngine(model, tok, static_cache=False, batch_size=3).sample(
        prompts, samples_per_prompt=2, seeds=seeds, temperature=temperature, top_p=top_p, max_new_tokens=64)
    T = chunked.completion_ids_B_T.shape[1]
    ref_m = completion_mask(ref_ids, eng.eos_ids)[0].bool()
    m = chunked.completion_mask_B_T.bool()
    assert T <= ref_ids.shape[1] and torch.equal(m, ref_m[:, :T]) and not ref_m[:, T:].any()
    assert torch.equal(chunked.completion_ids_B_T[m], ref_ids[:, :T][m])
    # other rows beside them (other padding, other matmul shapes): the same tokens, log-probs to float rounding
    torch.testing.assert_close(chunked.sampling_logp_B_T[m], ref_logp[:, :T][m], atol=1e-4, rtol=1e-5)

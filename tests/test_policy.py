"""The sampling convention (``engines.sampling``, ``loss_table``): the policy every engine samples
and records, and the one every loss differentiates, is softmax(z / τ) over the tokenizer's ids
truncated to its top-p nucleus. Held against references written here: a nucleus chosen in numpy,
exact enumeration of each sampled-token loss's expected gradient against autograd of the
divergence it names (on- and off-policy, at τ = 0.6 / top-p 0.95 with a nucleus that drops ids),
the full-vocabulary losses against plain formulas, and what each engine records against a
teacher-forced forward of the same model (embedded student; the real-scale fixture's 151,936 rows).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from opdkit import losses
from opdkit.engines.sampling import policy_logits, policy_scores

TAU, TOP_P = 0.6, 0.95
THETA_6 = [2.0, 1.5, 1.0, 0.3, -0.5, -1.5]  # at τ 0.6 / top-p 0.95 the nucleus is the first 3 ids


# ----------------------------------------------------------------------------- a reference policy


def ref_nucleus(z_V, tau: float, top_p: float) -> list[int]:
    """Ids of the smallest most-probable-first prefix of softmax(z / τ) whose mass reaches top_p (numpy)."""
    z = np.asarray(z_V, dtype=np.float64) / tau
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    k = int(np.searchsorted(np.cumsum(p[order]), top_p) + 1) if top_p < 1 else len(p)
    return sorted(order[:k].tolist())


def ref_policy_logp(theta_V: torch.Tensor, tau: float, top_p: float) -> torch.Tensor:
    """log π(v) for v in the nucleus, -inf elsewhere, differentiable in theta (the set held fixed)."""
    S = ref_nucleus(theta_V.detach().numpy(), tau, top_p)
    z_S = theta_V[S] / tau
    out = torch.full_like(theta_V, float("-inf"))
    return out.index_put((torch.tensor(S),), z_S - torch.logsumexp(z_S, 0))


def test_policy_logits_are_the_tempered_nucleus():
    g = torch.Generator().manual_seed(0)
    z_B_T_V = 2 * torch.randn(2, 3, 40, generator=g, dtype=torch.float64)
    got = policy_logits(z_B_T_V, TAU, 0.8).log_softmax(-1)
    for b in range(2):
        for t in range(3):
            want = ref_policy_logp(z_B_T_V[b, t], TAU, 0.8)
            assert torch.equal(torch.isfinite(got[b, t]), torch.isfinite(want))
            assert torch.allclose(got[b, t][torch.isfinite(want)], want[torch.isfinite(want)], atol=1e-12)
    assert len(ref_nucleus(THETA_6, TAU, TOP_P)) == 3  # the 6-token case really truncates
    assert policy_logits(z_B_T_V, 1.0, 1.0) is z_B_T_V  # temperature 1, no top-p: the logits themselves
    assert torch.equal(policy_logits(z_B_T_V, 0.0, 0.5), z_B_T_V)  # greedy: the model's own distribution
    cut = policy_logits(z_B_T_V, 1.0, 1.0, n_vocab=37)
    assert torch.isinf(cut[..., 37:]).all() and torch.equal(cut[..., :37], z_B_T_V[..., :37])


def test_recorded_logprobs_at_temperature_1_are_the_model_log_softmax_bit_for_bit():
    """The embedded default samples at τ = 1, top-p = 1: what it records (and so every number of
    its runs) is exactly what it recorded before the convention, log_softmax of the logits."""
    raw = torch.randn(4, 50)
    seeds = torch.arange(4)
    scores, logp = policy_scores(raw, seeds, 3, 1.0, 1.0)
    assert torch.equal(logp, raw.log_softmax(-1))
    scores_pad, logp_pad = policy_scores(raw, seeds, 3, 1.0, 1.0, n_vocab=45)
    assert torch.equal(logp_pad[:, :45], raw[:, :45].log_softmax(-1)) and torch.isinf(logp_pad[:, 45:]).all()
    assert (scores_pad.argmax(-1) < 45).all()


# ----------------------------------------------------------------------------- exact enumeration


def _call(kind, logp_1_1, old_1_1, teacher_1_1, **kw):
    one = torch.ones(1, 1, dtype=torch.float64)
    if kind == "k1":
        return losses.k1_loss(logp_1_1, old_1_1, teacher_1_1, one, 1.0, kw["clip_eps"], dual_clip=kw["dual_clip"])[0]
    return getattr(losses, f"{kind}_loss")(logp_1_1, old_1_1, teacher_1_1, one, 1.0)[0]


def expected_grad(kind, theta_V, teacher_logp_V, sampler_logp_V, tau, top_p, **kw):
    """Σ_v q(v) ∇_θ loss(v): token v drawn from the sampler q (its recorded log-prob is log q(v)),
    the loss evaluated on the policy the trainer differentiates (``policy_logits`` of θ)."""
    total_V = torch.zeros_like(theta_V)
    for v in range(theta_V.shape[0]):
        if not math.isfinite(float(sampler_logp_V[v])):
            continue  # q(v) = 0: never sampled
        logp_1_1 = policy_logits(theta_V, tau, top_p).log_softmax(-1)[v].reshape(1, 1)
        loss = _call(kind, logp_1_1, sampler_logp_V[v].reshape(1, 1), teacher_logp_V[v].reshape(1, 1), **kw)
        total_V += sampler_logp_V[v].exp() * torch.autograd.grad(loss, theta_V, allow_unused=True)[0]
    return total_V


def named_divergence_grad(kind, theta_V, teacher_logp_V, tau, top_p):
    """Autograd of the divergence the loss names, at the reference policy π_θ: KL(π || p_T) for k1
    and k2; for k3 the forward KL over the nucleus S, Σ_{v in S} p_T (log p_T - log π)."""
    logp_V = ref_policy_logp(theta_V, tau, top_p)
    S = torch.isfinite(logp_V)
    if kind in ("k1", "k2"):
        div = (logp_V[S].exp() * (logp_V[S] - teacher_logp_V[S])).sum()
    else:
        div = (teacher_logp_V[S].exp() * (teacher_logp_V[S] - logp_V[S])).sum()
    return torch.autograd.grad(div, theta_V)[0]


def _case(seed: int, V: int, off_policy: bool, tau: float = TAU, top_p: float = TOP_P):
    """(θ, teacher log-probs, the sampler's logits): the sampler is θ itself on-policy; off-policy
    θ plus noise, the first draw whose nucleus covers θ's (the importance weight corrects only there)."""
    g = torch.Generator().manual_seed(seed)
    theta_V = torch.tensor(THETA_6, dtype=torch.float64) if V == 6 and seed == 0 else \
        1.5 * torch.randn(V, generator=g, dtype=torch.float64)
    teacher_logp_V = torch.log_softmax(1.5 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    old_V = theta_V.clone()
    while off_policy:
        old_V = theta_V + 0.3 * torch.randn(V, generator=g, dtype=torch.float64)
        if set(ref_nucleus(theta_V.numpy(), tau, top_p)) <= set(ref_nucleus(old_V.numpy(), tau, top_p)):
            break
    return theta_V.requires_grad_(True), teacher_logp_V, old_V


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("tau,top_p", [(TAU, TOP_P), (TAU, 1.0), (1.1, 0.9)])
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_expected_gradient_at_the_sampling_settings_is_the_named_divergences(kind, tau, top_p, off_policy):
    """Tokens from the recorded sampling policy q (the engines' ``policy_scores``: the current
    student's policy on-policy, an older one off-policy), the loss on the policy the trainer
    differentiates: the expected gradient is autograd of the divergence the loss table names.
    Off-policy the nucleus of q must cover the current one (asserted: the importance weight
    corrects only there); k1 off-policy without clipping (clip_eps = inf)."""
    kw = {"clip_eps": math.inf, "dual_clip": 0.0} if off_policy else {"clip_eps": 0.2, "dual_clip": 3.0}
    for seed in range(4):
        theta_V, t_V, old_V = _case(seed, 6 if seed < 2 else 11, off_policy, tau, top_p)
        _, q_1_V = policy_scores(old_V[None], torch.zeros(1, dtype=torch.int64), 0, tau, top_p)
        q_V = q_1_V[0].double()
        assert off_policy == bool((q_V.exp() - ref_policy_logp(theta_V.detach(), tau, top_p).exp()).abs().max() > 1e-3)
        got_V = expected_grad(kind, theta_V, t_V, q_V, tau, top_p, **kw)
        want_V = named_divergence_grad(kind, theta_V, t_V, tau, top_p)
        assert _rel(got_V, want_V) < 1e-5, (seed, got_V, want_V)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_the_temperature_1_convention_was_biased_at_the_sampling_settings(kind):
    """What the kit did before: sample from π (τ 0.6, top-p 0.95) but record and rescore the
    temperature-1, untruncated log-probs. Its expected gradient misses the named divergence's (by
    10-40% here; bench/enumeration_bias.py prints the figures): the test above would fail on it."""
    theta_V, t_V, _ = _case(0, 6, False)
    pi_V = ref_policy_logp(theta_V.detach(), TAU, TOP_P)
    total_V = torch.zeros_like(theta_V)
    for v in torch.isfinite(pi_V).nonzero()[:, 0].tolist():
        raw_1_1 = theta_V.log_softmax(-1)[v].reshape(1, 1)
        loss = _call(kind, raw_1_1, raw_1_1.detach(), t_V[v].reshape(1, 1), clip_eps=0.2, dual_clip=3.0)
        total_V += pi_V[v].exp() * torch.autograd.grad(loss, theta_V)[0]
    assert _rel(total_V, named_divergence_grad(kind, theta_V, t_V, TAU, TOP_P)) > 0.05


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kind", ["rkl", "fkl", "jsd"])
def test_full_vocabulary_losses_follow_the_same_policy(kind, padded):
    """rkl / fkl / jsd of the policy logits (-inf outside the nucleus) equal the plain formulas on
    the reference π, value and gradient: reverse KL over the nucleus, forward KL over it, JSD with
    the mixture over every id; finite gradients, zero on the ids outside the nucleus. ``padded``: the
    last position is past the completion's end (mask 0), as every batch of unequal lengths has: the
    GPU lane's S2 (JSD 0.5, top-p 0.95) went NaN at step 1 on such a position (logaddexp(-inf, -inf))."""
    g = torch.Generator().manual_seed(1)
    theta_B_T_V = (2 * torch.randn(1, 3, 9, generator=g, dtype=torch.float64)).requires_grad_(True)
    t_B_T_V = torch.log_softmax(2 * torch.randn(1, 3, 9, generator=g, dtype=torch.float64), -1)
    mask = torch.tensor([[1.0, 1.0, 0.0 if padded else 1.0]], dtype=torch.float64)
    n = float(mask.sum())
    z = policy_logits(theta_B_T_V, TAU, 0.8)
    fn = {"rkl": losses.rkl_loss, "fkl": losses.fkl_loss, "jsd": lambda *a: losses.jsd_loss(*a, beta=0.5)}[kind]
    loss, _ = fn(z, t_B_T_V, mask, n)
    ref = torch.zeros((), dtype=torch.float64)
    for t in range(int(n)):
        lp, tl = ref_policy_logp(theta_B_T_V[0, t], TAU, 0.8), t_B_T_V[0, t]
        S = torch.isfinite(lp)
        if kind == "rkl":
            ref = ref + (lp[S].exp() * (lp[S] - tl[S])).sum()
        elif kind == "fkl":
            ref = ref + (tl[S].exp() * (tl[S] - lp[S])).sum()
        else:
            p, q = lp.exp(), tl.exp()
            m = 0.5 * p + 0.5 * q
            ref = ref + 0.5 * (q * (q / m).log()).sum() + 0.5 * (p[S] * (p[S] / m[S]).log()).sum()
    ref = ref / n
    g_got, g_ref = torch.autograd.grad(loss, theta_B_T_V)[0], torch.autograd.grad(ref, theta_B_T_V)[0]
    assert torch.isfinite(g_got).all() and abs(float(loss.detach() - ref.detach())) < 1e-6  # the losses run in fp32
    assert torch.allclose(g_got.double(), g_ref, atol=1e-6)
    assert (g_got[~torch.isfinite(z)] == 0).all()


def test_a_sampled_token_outside_the_current_nucleus_has_weight_zero():
    """Rounding at the nucleus' edge can leave a sampled token outside the nucleus recomputed in
    the update (log p_S = -inf): it drops out (weight p_S / q = 0) with finite gradients."""
    logp_B_T = torch.tensor([[-1.0, float("-inf"), -2.0]], requires_grad=True)
    old_B_T = torch.tensor([[-1.0, -6.0, -2.0]])
    teacher_B_T = torch.tensor([[-1.5, -3.0, -1.0]])
    mask_B_T = torch.ones(1, 3)
    for kind in ("k1", "k2", "k3"):
        kw = {"clip_eps": 0.2, "dual_clip": 3.0}
        loss, m = (losses.k1_loss(logp_B_T, old_B_T, teacher_B_T, mask_B_T, 3.0, **kw) if kind == "k1" else
                   getattr(losses, f"{kind}_loss")(logp_B_T, old_B_T, teacher_B_T, mask_B_T, 3.0))
        keep = [0, 2]
        kept = (logp_B_T[:, keep], old_B_T[:, keep], teacher_B_T[:, keep], mask_B_T[:, keep], 3.0)
        ref, m_ref = (losses.k1_loss(*kept, **kw) if kind == "k1" else getattr(losses, f"{kind}_loss")(*kept))
        grad = torch.autograd.grad(loss, logp_B_T)[0]
        assert torch.isfinite(grad).all() and grad[0, 1] == 0
        assert float(loss.detach()) == pytest.approx(float(ref.detach()))
        assert m["tokens"] == 2 and m["kl"] == pytest.approx(m_ref["kl"])


# ----------------------------------------------------------------------------- the update, end to end


@pytest.mark.parametrize("name", ["rkl", "k2", "k3"])
def test_the_training_step_differentiates_the_sampling_policy(tiny_llama, tok, name):
    """``step.micro_losses`` on a rollout at τ 0.6 / top-p 0.9: loss and LM-head gradient equal a
    reference from plain forwards of the models and the numpy nucleus (teacher at temperature 1)."""
    import copy

    from opdkit import opd, step as opd_step
    from opdkit.config import Config, replace
    from opdkit.engines.hf import HFEngine

    cfg = replace(Config(), f"loss.name={name}", "rollout.temperature=0.6", "rollout.top_p=0.9",
                  "runtime.logprob_chunk=5")
    student = copy.deepcopy(tiny_llama).train()
    torch.manual_seed(5)
    teacher = copy.deepcopy(tiny_llama).eval()
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.3 * torch.randn_like(p))
    prompts = [tok("Compute 47+5-29.").input_ids, tok("Compute 3+4.").input_ids]
    ro = HFEngine(student, tok).sample(prompts, samples_per_prompt=2, seeds=[1, 2, 3, 4], temperature=0.6, top_p=0.9,
                                       max_new_tokens=12)
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    kw = {"rollout": cfg.rollout, "runtime": cfg.runtime, "micro_batch": cfg.optim.micro_batch}
    ctx = opd_step.score_batch(cfg.loss, teacher, batch, __import__("contextlib").nullcontext, **kw)
    m = opd_step.micro_losses(cfg.loss, student, batch, ctx, __import__("contextlib").nullcontext, **kw)
    got_grad = student.lm_head.weight.grad.clone()
    student.zero_grad()

    ref = torch.zeros(())
    n = float(ro.completion_mask_B_T.sum())
    for b in range(ro.completion_ids_B_T.shape[0]):
        keep = ro.prompt_mask_B_Sp[b].bool()
        k = int(ro.completion_mask_B_T[b].sum())
        ids = torch.cat([ro.prompt_ids_B_Sp[b][keep], ro.completion_ids_B_T[b, :k]])[None]
        s_logits, first = student(input_ids=ids).logits[0].double(), int(keep.sum()) - 1
        with torch.no_grad():
            t_logp = teacher(input_ids=ids).logits[0].double().log_softmax(-1)
        for t in range(k):
            y = int(ro.completion_ids_B_T[b, t])
            lp, tl = ref_policy_logp(s_logits[first + t], 0.6, 0.9), t_logp[first + t]
            S = torch.isfinite(lp)
            if name == "rkl":
                ref = ref + (lp[S].exp() * (lp[S] - tl[S])).sum()
            else:
                w = torch.exp(lp[y].detach() - ro.sampling_logp_B_T[b, t].double())
                d = lp[y] - tl[y]
                ref = ref + w * (0.5 * d ** 2 if name == "k2" else torch.expm1(-d) + d)
    ref = ref / n
    ref.backward()
    assert m["loss"] == pytest.approx(float(ref.detach()), rel=1e-4, abs=1e-6)
    assert torch.allclose(got_grad.double(), student.lm_head.weight.grad.double(), atol=1e-5, rtol=1e-3)


# ----------------------------------------------------------------------------- what the engines record


def _forward_policy_logp(model, ro, n_vocab, tau, top_p):
    """log π of each sampled token from one plain full-sequence forward of ``model`` (no cache)
    and the numpy nucleus: (B, T) float64, for the masked-in tokens."""
    out = torch.zeros(ro.completion_ids_B_T.shape, dtype=torch.float64)
    Sp = ro.prompt_ids_B_Sp.shape[1]
    for b in range(out.shape[0]):
        n = int(ro.completion_mask_B_T[b].sum())
        keep = ro.prompt_mask_B_Sp[b].bool()
        ids = torch.cat([ro.prompt_ids_B_Sp[b][keep], ro.completion_ids_B_T[b, :n]])[None]
        with torch.no_grad():
            logits_S_V = model(input_ids=ids).logits[0].double()[:, :n_vocab]
        first = int(keep.sum()) - 1  # the column that predicts completion token 0
        for t in range(n):
            lp = ref_policy_logp(logits_S_V[first + t], tau, top_p)
            out[b, t] = lp[ro.completion_ids_B_T[b, t]]
    assert Sp >= 1
    return out


def _engines(model, tok):
    """The CPU engines: HF generate, and the static decoder run eagerly (fp32 copy)."""
    from opdkit.engines.base import sampling_vocab
    from opdkit.engines.hf import HFEngine
    from opdkit.engines.static import StaticDecoder

    gen = HFEngine(model, tok)
    static = HFEngine(model, tok)
    static.decoder = StaticDecoder(model, dtype=torch.float32, use_graphs=False, n_vocab=sampling_vocab(model, tok))
    return {"generate": gen, "static": static}


def _check_engines_record_log_pi(model, tok, prompts, n_vocab, T, G=2):
    from opdkit import opd
    from opdkit.scoring import completion_hidden, token_logprobs, unwrap

    for name, engine in _engines(model, tok).items():
        for tau, top_p in ((TAU, TOP_P), (1.0, 1.0)):
            ro = engine.sample(prompts, samples_per_prompt=G, seeds=opd.step_seeds(3, 1, len(prompts) * G),
                               temperature=tau, top_p=top_p, max_new_tokens=T)
            m = ro.completion_mask_B_T.bool()
            assert int(ro.completion_ids_B_T[m].max()) < n_vocab, name
            want = _forward_policy_logp(model, ro, n_vocab, tau, top_p)
            assert torch.isfinite(want[m]).all(), (name, "a sampled token outside the nucleus it was drawn from")
            assert (ro.sampling_logp_B_T.double()[m] - want[m]).abs().max() < 1e-4, (name, tau)
            with torch.no_grad():  # and the trainer's recompute (the alignment check's) agrees
                g = opd.student_geometry(opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp))
                again = token_logprobs(unwrap(model)[1], completion_hidden(model, g), ro.completion_ids_B_T, 7, tau,
                                       top_p)
            assert (again[m] - ro.sampling_logp_B_T[m]).abs().max() < 1e-4, (name, tau)
            if tau != 1.0:  # not the temperature-1 log-probs
                assert (want[m] - _forward_policy_logp(model, ro, n_vocab, 1.0, 1.0)[m]).abs().max() > 0.05


def test_engines_record_log_pi_on_the_embedded_student():
    from opdkit import paths
    from opdkit.config import Config
    from opdkit.models import load_model, load_tokenizer

    tok = load_tokenizer(paths.student_path(Config()))
    model = load_model(paths.student_path(Config()), torch.device("cpu"), torch.float32, "student").eval()
    prompts = [tok("Compute 47+5-29.").input_ids, tok("Compute 3+4.").input_ids]
    _check_engines_record_log_pi(model, tok, prompts, len(tok), T=16)


def test_engines_record_log_pi_on_the_real_scale_fixture(tmp_path_factory):
    """Qwen2.5's tokenizer (151,665 ids) on a head of 151,936 rows, Qwen2.5's chat template."""
    from opdkit.models import load_model, load_tokenizer
    from qwen2_fixture import fixture_dir

    fx = fixture_dir(tmp_path_factory)
    tok = load_tokenizer(fx / "student")
    model = load_model(fx / "student", torch.device("cpu"), torch.float32, "student").eval()
    assert model.get_output_embeddings().weight.shape[0] == 151936 and len(tok) == 151665
    msgs = [[{"role": "user", "content": "What is 7 * 8?"}], [{"role": "user", "content": r"Solve $x^2 = 4$."}]]
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in msgs]
    _check_engines_record_log_pi(model, tok, prompts, len(tok), T=6)


def test_a_top_p_outside_0_1_is_refused_before_anything_is_written():
    from opdkit.config import ConfigError, load_config
    from opdkit.engines.select import check_params

    for bad in ("0", "-0.5", "1.5"):
        with pytest.raises(ConfigError, match="rollout.top_p"):
            check_params(load_config(None, [f"rollout.top_p={bad}"]), torch.device("cpu"))
    check_params(load_config(None, ["rollout.top_p=0.95", "rollout.temperature=0.6"]), torch.device("cpu"))

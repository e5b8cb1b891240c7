"""The top-K losses users ask for (opdkit.topk_losses): the student's top-K renormalised reverse KL
against a definition written out with python sums (float64) and its gradient by central finite
differences of that definition; verl's top-K diagnostics (teacher_mass, student_mass, overlap_ratio)
against the same quantities counted with python sets, for every top-K loss."""

import math

import pytest
import torch

from opdkit import loss_table, losses

B, T, V = 2, 3, 7
MASK_B_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # one padding position
N_TOKENS = 9.0


def _inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits_B_T_V = (2.0 * torch.randn(B, T, V, generator=g, dtype=dtype)).requires_grad_(True)
    teacher_B_T_V = torch.log_softmax(2.0 * torch.randn(B, T, V, generator=g, dtype=dtype), -1)
    teacher_B_T_V[0, 2] = float("nan")  # garbage at the padding position must not leak
    return logits_B_T_V, teacher_B_T_V


def _positions():
    return [(b, t) for b in range(B) for t in range(T) if MASK_B_T[b, t] != 0]


def _support(z_V: list[float], k: int) -> list[int]:
    """The student's top-k ids by plain sorting (ids with -inf logits, p_S = 0, left out)."""
    order = sorted(range(len(z_V)), key=lambda i: -z_V[i])
    return [i for i in order[:k] if z_V[i] != -math.inf]


def _reference_value(z_B_T_V: list, t_B_T_V: list, k: int, support=None) -> float:
    """sum over positions of sum_{i in S} q_S(i) log(q_S(i) / q_T(i)), q renormalised over S, / N_TOKENS;
    probabilities with math.exp and python sums. ``support``: S per position held fixed (else recomputed)."""
    total = 0.0
    for b, t in _positions():
        z, lt = z_B_T_V[b][t], t_B_T_V[b][t]
        S = support[(b, t)] if support else _support(z, k)
        zs = sum(math.exp(z[i]) for i in S)
        ts = sum(math.exp(lt[i]) for i in S)
        for i in S:
            qs, qt = math.exp(z[i]) / zs, math.exp(lt[i]) / ts
            total += qs * math.log(qs / qt)
    return total / N_TOKENS


def _finite_difference_grad(logits_B_T_V, teacher_B_T_V, k, h=1e-6):
    """d(reference)/d(logit), central differences, with S held at the unperturbed top-k (the
    definition's gradient: S is locally constant)."""
    z = logits_B_T_V.detach().tolist()
    t = teacher_B_T_V.tolist()
    S = {(b, tt): _support(z[b][tt], k) for b, tt in _positions()}
    g = torch.zeros(B, T, V, dtype=torch.float64)
    for b, tt in _positions():
        for v in range(V):
            up = [[row[:] for row in seq] for seq in z]
            dn = [[row[:] for row in seq] for seq in z]
            up[b][tt][v] += h
            dn[b][tt][v] -= h
            g[b, tt, v] = (_reference_value(up, t, k, S) - _reference_value(dn, t, k, S)) / (2 * h)
    return g


@pytest.mark.parametrize("k", [1, 3, 5])
def test_topk_rkl_is_the_renormalised_reverse_kl_over_the_students_top_k(k):
    logits, teacher = _inputs()
    loss, m = losses.topk_rkl_loss(logits, teacher, MASK_B_T, N_TOKENS, k=k)
    ref = _reference_value(logits.detach().tolist(), teacher.tolist(), k)
    assert loss.item() == pytest.approx(ref, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logits)
    want = _finite_difference_grad(logits, teacher, k)
    assert torch.allclose(grad, want, atol=1e-8, rtol=0), (grad - want).abs().max()
    assert grad[0, 2].abs().max() == 0  # padding
    for b, t in _positions():  # outside S: no gradient at all (the mass that leaves S is not seen)
        outside = [i for i in range(V) if i not in _support(logits[b, t].tolist(), k)]
        assert grad[b, t, outside].abs().max() == 0 if outside else True
    if k == 1:  # one id renormalised is a point mass on both sides: nothing to learn
        assert loss.item() == 0 and grad.abs().max() == 0
    assert m["rkl_topk"] == pytest.approx(ref * N_TOKENS / 5, abs=1e-6)  # metrics are float32


def test_topk_rkl_gradient_is_the_written_out_formula():
    """∂L/∂z_j = q_S(j) (log(q_S(j) / q_T(j)) - L_t) on S, 0 off S (per position, / n_tokens)."""
    logits, teacher = _inputs(seed=1)
    k = 4
    loss, _ = losses.topk_rkl_loss(logits, teacher, MASK_B_T, N_TOKENS, k=k)
    (grad,) = torch.autograd.grad(loss, logits)
    for b, t in _positions():
        z, lt = logits[b, t].tolist(), teacher[b, t].tolist()
        S = _support(z, k)
        qs = {i: math.exp(z[i]) / sum(math.exp(z[j]) for j in S) for i in S}
        qt = {i: math.exp(lt[i]) / sum(math.exp(lt[j]) for j in S) for i in S}
        L = sum(qs[i] * math.log(qs[i] / qt[i]) for i in S)
        for j in range(V):
            want = qs[j] * (math.log(qs[j] / qt[j]) - L) / N_TOKENS if j in S else 0.0
            assert grad[b, t, j].item() == pytest.approx(want, abs=1e-12)


def test_topk_rkl_at_k_equal_v_is_rkl():
    logits, teacher = _inputs(dtype=torch.float32)
    loss, m = losses.topk_rkl_loss(logits, teacher, MASK_B_T, N_TOKENS, k=V)
    ref, m_ref = losses.rkl_loss(logits, teacher, MASK_B_T, N_TOKENS)
    assert torch.allclose(loss, ref, atol=1e-6)
    g, g_ref = (torch.autograd.grad(x, logits)[0] for x in (loss, ref))
    assert torch.allclose(g, g_ref, atol=1e-6)
    assert m["kl"] == pytest.approx(m_ref["kl"], abs=1e-6) and m["rkl_topk"] == pytest.approx(m_ref["kl"], abs=1e-5)
    assert m["student_support_mass"] == pytest.approx(1.0, abs=1e-6)
    assert m["teacher_support_mass"] == pytest.approx(1.0, abs=1e-6)


def test_topk_rkl_support_excludes_ids_outside_the_nucleus():
    """With top-p < 1 the policy's logits are -inf outside the nucleus: those ids are not in S even
    when k is larger than the nucleus (their q_S would be 0 and their teacher mass would still count)."""
    logits, teacher = _inputs(seed=2)
    z = logits.detach().clone()
    z[..., 4:] = float("-inf")  # a 4-id nucleus everywhere
    z.requires_grad_(True)
    loss, m = losses.topk_rkl_loss(z, teacher, MASK_B_T, N_TOKENS, k=6)
    ref = _reference_value(z.detach().tolist(), teacher.tolist(), 6)
    assert loss.item() == pytest.approx(ref, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, z)
    assert torch.isfinite(grad).all() and grad[..., 4:].abs().max() == 0
    assert m["student_support_mass"] == pytest.approx(1.0, abs=1e-12)


def test_topk_rkl_same_distribution_is_zero_and_teacher_temperature_tempers_the_teacher():
    logits, _ = _inputs()
    teacher = torch.log_softmax(logits.detach(), -1)
    loss, m = losses.topk_rkl_loss(logits, teacher, MASK_B_T, N_TOKENS, k=3)
    assert abs(loss.item()) < 1e-12 and torch.autograd.grad(loss, logits)[0].abs().max() < 1e-12
    assert m["kl"] == pytest.approx(0.0, abs=1e-12) and m["overlap_ratio"] == 1.0
    # a teacher at temperature 2: the same as passing softmax(z_T / 2) itself
    z_t = 3.0 * torch.randn(B, T, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    a, _ = losses.topk_rkl_loss(logits, torch.log_softmax(z_t, -1), MASK_B_T, N_TOKENS, k=4, teacher_temperature=2.0)
    b, _ = losses.topk_rkl_loss(logits, torch.log_softmax(z_t / 2.0, -1), MASK_B_T, N_TOKENS, k=4)
    assert a.item() == pytest.approx(b.item(), abs=1e-12)


def test_topk_rkl_micro_batches_add_up():
    logits, teacher = _inputs()
    full, _ = losses.topk_rkl_loss(logits, teacher, MASK_B_T, N_TOKENS, k=3)
    halves = [losses.topk_rkl_loss(logits[s], teacher[s], MASK_B_T[s], N_TOKENS, k=3)[0]
              for s in (slice(0, 1), slice(1, 2))]
    assert torch.allclose(halves[0] + halves[1], full, atol=1e-12)


# ----------------------------------------------------------------------------- verl's diagnostics


def _verl_diagnostics(student_logp_B_T_V, teacher_logp_B_T_V, K):
    """teacher_mass, student_mass (both over the teacher's top-K T) and overlap_ratio (|T ∩ S_K| / K),
    means over the masked positions, from sorted python lists and sets."""
    tm, sm, ov = [], [], []
    for b, t in _positions():
        s, lt = student_logp_B_T_V[b][t], teacher_logp_B_T_V[b][t]
        T_ids = set(sorted(range(V), key=lambda i: -lt[i])[:K])
        S_ids = set(sorted(range(V), key=lambda i: -s[i])[:K])
        tm.append(sum(math.exp(lt[i]) for i in T_ids))
        sm.append(sum(math.exp(s[i]) for i in T_ids))
        ov.append(len(T_ids & S_ids) / K)
    n = len(tm)
    return {"teacher_mass": sum(tm) / n, "student_mass": sum(sm) / n, "overlap_ratio": sum(ov) / n}


@pytest.mark.parametrize("name", ["topk_fkl", "topk_rkl"])
@pytest.mark.parametrize("K", [2, 4])
def test_every_topk_loss_logs_verls_diagnostics(name, K):
    logits, teacher = _inputs(seed=3, dtype=torch.float32)
    teacher[0, 2] = torch.log_softmax(torch.zeros(V), -1)  # ranked below, masked out
    if name == "topk_fkl":
        ids = teacher.topk(K, -1).indices
        _, m = losses.topk_fkl_loss(logits, ids, teacher.gather(-1, ids), MASK_B_T, N_TOKENS)
    else:
        _, m = losses.topk_rkl_loss(logits, teacher, MASK_B_T, N_TOKENS, k=K)
    want = _verl_diagnostics(torch.log_softmax(logits.detach(), -1).tolist(), teacher.tolist(), K)
    for key, value in want.items():
        assert m[key] == pytest.approx(value, abs=1e-6), key
    assert set(loss_table.spec(name).metrics) >= set(want)  # declared in the table, so logged in train.jsonl
    if name == "topk_fkl":  # the same masses under the kit's older names
        assert m["teacher_topk_mass"] == m["teacher_mass"] and m["student_topk_mass"] == m["student_mass"]


def test_topk_rkl_support_masses():
    logits, teacher = _inputs(seed=4, dtype=torch.float32)
    _, m = losses.topk_rkl_loss(logits, teacher, MASK_B_T, N_TOKENS, k=3)
    s = torch.log_softmax(logits.detach(), -1)
    sm, tm = [], []
    for b, t in _positions():
        S = _support(s[b, t].tolist(), 3)
        sm.append(sum(math.exp(s[b, t, i].item()) for i in S))
        tm.append(sum(math.exp(teacher[b, t, i].item()) for i in S))
    assert m["student_support_mass"] == pytest.approx(sum(sm) / 5, abs=1e-6)
    assert m["teacher_support_mass"] == pytest.approx(sum(tm) / 5, abs=1e-6)


@pytest.mark.parametrize("loss,random_role,status", [
    (["loss.name=topk_fkl", "loss.tail_bucket=false"], "teacher", "WARN"),
    (["loss.name=topk_fkl", "loss.tail_bucket=true"], "teacher", "OK"),  # the tail bucket keeps the rest in the loss
    (["loss.name=topk_rkl"], "student", "WARN"),
    (["loss.name=topk_rkl"], "teacher", "OK"),
])
def test_the_doctor_reports_the_topk_masses(tmp_path, tiny_llama, tok, loss, random_role, status):
    """opdkit doctor with a top-K loss (K = 2 of the 33 ids): verl's masses on its batch, and a warning
    when the loss's support holds under 90% of the distribution it sets aside (topk_fkl: the teacher's,
    unless the tail bucket keeps the rest; topk_rkl: the student's). A random-weight model (near-uniform
    over the ids) in one role, the embedded model in the other."""
    from opdkit.config import load_config
    from opdkit.doctor import diagnose

    tiny_llama.save_pretrained(tmp_path / "random")
    tok.save_pretrained(tmp_path / "random")
    c = load_config(None, [*loss, "loss.topk=2", f"{random_role}.path={tmp_path / 'random'}", "runtime.threads=1",
                           "doctor.n_prompts=2", "doctor.max_new_tokens=8"])
    (f,) = [f for f in diagnose(c) if f.check == "top-K mass"]
    assert f.status == status and "teacher_mass" in f.detail and "overlap_ratio" in f.detail, f

"""Offline OPD (rollout.source: offline, opdkit.offline): a pool drawn by the run's own student with the
run's seed is, with weights that do not change, the online run bit for bit; with learning, step 2 trains
on the pool's batch with the behaviour (or the current student's) log-probs as the ratio's reference;
the expected update of each supported loss, by exact enumeration of every sequence of a tiny tabular
policy, follows the divergence opdkit.offline states (with and without the ratio); what cannot train
offline is refused before anything is written."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.distributions import Categorical, kl_divergence

from opdkit import losses, offline, opd, step as opd_step
from opdkit.config import load_config
from opdkit.data import prompt_indices
from opdkit.engines.sampling import sample_seed
from opdkit.offline_draw import draw_pool
from opdkit.setup import RunError, build_run, prepare_inputs
from opdkit.train import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "runtime.threads=1", "budget.max_wall_time_s=0", "optim.schedule=constant", "optim.warmup_steps=0",
        "tracking=none", "data.order=stored"]
KEYS = ("loss", "kl", "grad_norm", "tokens", "ratio_max", "fkl_topk", "teacher_mass", "overlap_ratio")


def cfg(*overrides: str):
    return load_config(None, [*TINY, *overrides])


def run(out: Path, *overrides: str) -> list[dict]:
    train(cfg(*overrides), out, log=lambda s: None, progress=False)
    return [json.loads(ln) for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]


def pool(path: Path, *overrides: str, **kw) -> Path:
    draw_pool(cfg(*overrides), None, path, log=lambda s: None, progress=False, **kw)
    return path


@pytest.mark.parametrize("loss", [("loss.name=k1",), ("loss.name=topk_fkl", "loss.topk=4")], ids=["k1", "topk_fkl"])
def test_with_weights_that_do_not_change_offline_is_the_online_run(tmp_path, loss):
    """lr = 0: the pool drawn by the run's student with its seed holds the run's prompts, samples and
    teacher scores, so every logged number is the online run's, bit for bit (the pool's batch is laid
    out as the engine's, its behaviour log-probs are the engine's, its teacher scores the teacher's)."""
    common = ("budget.max_steps=3", "optim.lr=0.0", *loss)
    on = run(tmp_path / "on", *common)
    p = pool(tmp_path / "pool.parquet", *common)
    off = run(tmp_path / "off", *common, "rollout.source=offline", f"rollout.offline_file={p}")
    assert len(on) == len(off) == 3
    for a, b in zip(on, off):
        assert {k: a.get(k) for k in KEYS} == {k: b.get(k) for k in KEYS}
    assert "alignment" in off[0]  # the pool's policy is the run's student: the first-batch check ran, and passed
    meta = offline.read_meta(p)
    assert meta["topk"] == (4 if "loss.topk=4" in loss else 0) and meta["n_prompts"] == 6


def test_the_pool_holds_the_online_runs_prompts_and_seeds(tmp_path):
    c = cfg("budget.max_steps=2", "data.order=shuffled", "seed=3")
    p = pool(tmp_path / "pool.parquet", "budget.max_steps=2", "data.order=shuffled", "seed=3")
    got = offline.read_pool(p)
    inputs = prepare_inputs(c)
    assert got.rows == prompt_indices(3, len(inputs.examples), 0, 4, "shuffled")
    import pyarrow.parquet as pq

    cols = pq.read_table(p).to_pydict()
    P, G = 2, 2
    want = [sample_seed(3, i // P, (i % P) * G + g) for i in range(4) for g in range(G)]
    assert [s for _, s in sorted(zip(zip(cols["prompt_index"], cols["sample"]), cols["seed"]))] == want
    m = got.meta
    assert m["policy_fingerprint"] == offline.model_fingerprint(inputs.student_path)
    assert m["teacher_fingerprint"] == offline.model_fingerprint(inputs.teacher_path) != m["policy_fingerprint"]
    assert m["data_fingerprint"] == inputs.data_fingerprint and m["seconds"]["rollout"] > 0
    for comp, beh, tea in zip(cols["completion_ids"], cols["behaviour_logp"], cols["teacher_logp"]):
        assert len(comp) == len(beh) == len(tea) > 0 and all(x <= 0 for x in beh + tea)


@pytest.mark.parametrize("ratio", ["behaviour", "none"])
def test_step_2_trains_on_the_pools_batch(tmp_path, ratio):
    """lr > 0: step 2's loss is the loss of the weights after step 1 on the pool's step-2 batch, scored by
    the stored teacher, with the behaviour log-probs as k1's PPO reference (behaviour: ratio θ1 / θ0 on
    the stored tokens, max > 1) or the current student's own (none: ratio 1), recomputed here from the
    library's step functions."""
    common = ("budget.max_steps=2", "optim.lr=3e-3", "loss.name=k1", "publish.every_steps=1", "publish.keep=2",
              f"rollout.offline_ratio={ratio}")
    p = pool(tmp_path / "pool.parquet", *common)
    off = run(tmp_path / "off", *common, "rollout.source=offline", f"rollout.offline_file={p}")
    c = cfg(*common, "rollout.source=offline", f"rollout.offline_file={p}")
    inputs = prepare_inputs(c)
    r = build_run(c, inputs, log=lambda s: None)
    theta1 = load_file(tmp_path / "off" / "checkpoints" / "checkpoint-1" / "model.safetensors")
    assert not r.student.load_state_dict(theta1, strict=False).unexpected_keys
    served = r.teacher
    served.sync_weights(r.student)
    P, G = c.rollout.prompts_per_step, c.rollout.samples_per_prompt
    examples = [inputs.examples[i] for i in prompt_indices(c.seed, len(inputs.examples), P, P, c.data.order)]
    ro = served.sample(r.prompts(examples), samples_per_prompt=G, seeds=[], temperature=1.0, top_p=1.0,
                       max_new_tokens=c.rollout.max_new_tokens)
    assert ro.completion_ids_B_T.shape[0] == P * G
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    kw = {"rollout": c.rollout, "runtime": c.runtime, "micro_batch": c.optim.micro_batch}
    m = opd_step.micro_losses(c.loss, r.student, batch, opd_step.score_batch(c.loss, served, batch, r.autocast, **kw),
                              r.autocast, **kw)
    assert abs(m["loss"] - off[1]["loss"]) < 1e-6 and abs(m["kl"] - off[1]["kl"]) < 1e-6
    if ratio == "behaviour":
        assert off[1]["ratio_max"] > 1.0 + 1e-4  # the stored log-probs are θ0's
    else:
        assert abs(off[1]["ratio_max"] - 1.0) < 1e-6 and abs(off[0]["ratio_max"] - 1.0) < 1e-6


# ----------------------------------------------------------------------------- expected updates, enumerated

V = 3  # ids; sequences of 2 tokens, every one enumerated


def _tables(seed):
    g = torch.Generator().manual_seed(seed)

    def table(scale=1.5):
        return (scale * torch.randn(V, generator=g, dtype=torch.float64),
                scale * torch.randn(V, V, generator=g, dtype=torch.float64))  # position 0; position 1 per first token

    theta = [x.requires_grad_(True) for x in table()]  # the student p_S
    return theta, table(), table()  # student, behaviour μ, teacher p_T (logits)


def _logp(tab, a=None):
    """log-probs of position 0 (a None) or of position 1 after first token a."""
    return torch.log_softmax(tab[0] if a is None else tab[1][a], -1)


def _expected(kind, ratio, theta, mu, teacher, K=2):
    """sum over every sequence y = (a, b) of μ(y) ∇_θ loss(y), each y one stored rollout (B = 1, T = 2,
    n_tokens = 1) with the inputs the offline path gives the loss."""
    total = [torch.zeros_like(x) for x in theta]
    for a, b in itertools.product(range(V), range(V)):
        w = math.exp(_logp(mu)[a] + _logp(mu, a)[b])
        s_1_T = torch.stack([_logp(theta)[a], _logp(theta, a)[b]])[None]
        t_1_T = torch.stack([_logp(teacher)[a], _logp(teacher, a)[b]])[None]
        old_1_T = torch.stack([_logp(mu)[a], _logp(mu, a)[b]])[None] if ratio == "behaviour" else s_1_T.detach()
        one = torch.ones(1, 2, dtype=torch.float64)
        if kind == "k1":
            loss, _ = losses.k1_loss(s_1_T, old_1_T, t_1_T, one, 1.0, math.inf, dual_clip=0.0)
        elif kind in ("k2", "k3"):
            loss, _ = getattr(losses, f"{kind}_loss")(s_1_T, old_1_T, t_1_T, one, 1.0)
        else:  # topk_fkl: the whole top-K (+ tail) at each stored prefix, the teacher's top-K stored
            logits_1_T_V = torch.stack([theta[0], theta[1][a]])[None]
            t_1_T_V = torch.stack([_logp(teacher), _logp(teacher, a)])[None]
            top = t_1_T_V.topk(K, -1)
            loss, _ = losses.topk_fkl_loss(logits_1_T_V, top.indices, top.values, one, 1.0, tail_bucket=True)
        for acc, g in zip(total, torch.autograd.grad(loss, theta)):
            acc += w * g
    return total


def _kl(p_logp, q_logp):
    return kl_divergence(Categorical(logits=p_logp), Categorical(logits=q_logp))


def _bucket_fkl(t_logp, s_logp, K):
    """KL over the teacher's top-K ids plus one bucket for the rest, written out."""
    top = sorted(range(V), key=lambda i: -float(t_logp[i]))[:K]
    rest = [i for i in range(V) if i not in top]
    pt = [t_logp[i].exp() for i in top] + [sum(t_logp[i].exp() for i in rest)]
    ps = [s_logp[i].exp() for i in top] + [sum(s_logp[i].exp() for i in rest)]
    return sum(x * torch.log(x / y) for x, y in zip(pt, ps))


def _target(kind, ratio, theta, mu, teacher, prefix_policy, K=2):
    """∇_θ of the objective opdkit.offline states: a per-position term at position 0, plus the same
    at position 1 weighted by the prefix policy's first-token probabilities (constants)."""

    def per_position(s, t, m):
        if kind == "topk_fkl":
            return _bucket_fkl(t, s, K)
        if ratio == "behaviour":
            return _kl(t, s) if kind == "k3" else _kl(s, t)  # k3: forward KL; k1, k2: reverse KL
        if kind == "k3":  # E_{v ~ μ}[p_T / p_S + log p_S]
            return (m.exp() * ((t - s).exp() + s)).sum()
        return (m.exp() * 0.5 * (s - t) ** 2).sum()  # k1, k2: E_{v ~ μ}[½ (log p_S - log p_T)²]

    w_A = _logp(prefix_policy).exp().detach()
    obj = per_position(_logp(theta), _logp(teacher), _logp(mu))
    obj = obj + sum(w_A[a] * per_position(_logp(theta, a), _logp(teacher, a), _logp(mu, a)) for a in range(V))
    return torch.autograd.grad(obj, theta)


@pytest.mark.parametrize("kind,ratio", [("k1", "behaviour"), ("k2", "behaviour"), ("k3", "behaviour"),
                                        ("k1", "none"), ("k2", "none"), ("k3", "none"),
                                        ("topk_fkl", "behaviour"), ("topk_fkl", "none")])
def test_expected_offline_update_follows_the_stated_divergence(kind, ratio):
    """Σ_y μ(y) ∇loss(y) over every stored sequence y of a 3-id, 2-token tabular policy μ equals ∇ of
    the objective opdkit.offline's docstring states, the prefixes weighted by μ; and not the online
    update's (prefixes weighted by p_S): the token ratio corrects the sampled token, not the prefix."""
    for seed in range(3):
        theta, mu, teacher = _tables(seed)
        got = _expected(kind, ratio, theta, mu, teacher)
        want = _target(kind, ratio, theta, mu, teacher, prefix_policy=mu)
        tol = 1e-6 if kind == "topk_fkl" else 1e-10  # topk_fkl computes in float32, the token losses keep float64
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=tol, rtol=0), (g - w).abs().max()
        online = _target(kind, ratio, theta, mu, teacher, prefix_policy=[x.detach() for x in theta])
        assert max((g - o).abs().max() for g, o in zip(got, online)) > 1e-3


def test_without_the_ratio_k1_is_not_the_reverse_kl():
    """offline_ratio=none changes what k1 follows whenever μ is not the student (told apart here)."""
    theta, mu, teacher = _tables(0)
    a = _expected("k1", "behaviour", theta, mu, teacher)
    b = _expected("k1", "none", theta, mu, teacher)
    assert max((x - y).abs().max() for x, y in zip(a, b)) > 1e-3


# ----------------------------------------------------------------------------- what is refused


@pytest.mark.parametrize("extra,match", [
    (("loss.name=rkl",), "whole vocabulary"), (("loss.name=topk_rkl",), "whole vocabulary"),
    (("loss.name=jsd",), "whole vocabulary"), (("loss.name=sft",), "teacher samples or reference"),
    (("loss.name=k1", "loss.reward_weight=0.5"), "reward"), (("loss.name=k1", "rollout.overlap=1"), "overlap"),
    (("loss.name=k1", "teacher.source=privileged_fixed"), "teacher model"),
])
def test_what_cannot_train_offline_is_refused(tmp_path, extra, match):
    with pytest.raises(RunError, match=match):
        prepare_inputs(cfg("budget.max_steps=1", "rollout.source=offline",
                           f"rollout.offline_file={tmp_path / 'x.parquet'}", *extra))


def test_a_pool_that_does_not_fit_the_params_is_refused(tmp_path):
    base = ("budget.max_steps=1", "loss.name=topk_fkl", "loss.topk=3")
    p = pool(tmp_path / "pool.parquet", *base)
    off = ("rollout.source=offline", f"rollout.offline_file={p}")
    prepare_inputs(cfg(*base, *off))  # fits
    bad = {("rollout.temperature=0.7",): "rollout.temperature", ("loss.topk=8",): "top-3",
           ("rollout.samples_per_prompt=4",): "rollout.samples_per_prompt", ("data.max_rows=100",): "training rows",
           (f"teacher.path={ROOT / 'opdkit' / 'embedded' / 'assets' / 'student'}",): "scored by the teacher"}
    for extra, match in bad.items():
        with pytest.raises(RunError, match=match):
            prepare_inputs(cfg(*base, *off, *extra))
    with pytest.raises(RunError, match="does not exist"):
        prepare_inputs(cfg(*base, "rollout.source=offline", f"rollout.offline_file={tmp_path / 'none.parquet'}"))
    with pytest.raises(RunError, match="rollout.offline_file"):
        prepare_inputs(cfg(*base, "rollout.source=offline"))


def test_the_train_stage_points_offline_runs_at_the_pool(tmp_path):
    """The pipeline's offline arm (dvc exp run -S rollout.source=offline): each OPD run reads the
    pool (its -S and an input of its job); the supervised controls stay live and do not read it."""
    from opdkit.stages.train_runs import train_jobs

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["rollout"]["source"] = "offline"
    params["loss"]["name"] = params["pipeline"]["baseline_arm"] = "k1"
    params["recipe"] = str(ROOT / "recipes" / "embedded.yaml")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    jobs = train_jobs(str(tmp_path / "params.yaml"), "S", "T", "D", "runs/train", "logs", pool="POOL")
    for job in jobs:
        opd_arm = job.name.startswith("k1/")
        assert ("rollout.offline_file=POOL" in job.argv) == opd_arm and ("POOL" in job.inputs) == opd_arm, job.name
        assert job.config["rollout"]["source"] == ("offline" if opd_arm else "live"), job.name


def test_the_doctor_checks_the_pool(tmp_path):
    from opdkit import pairs
    from opdkit.doctor import offline_finding

    p = pool(tmp_path / "pool.parquet", "budget.max_steps=1", "loss.name=k1")
    c = cfg("budget.max_steps=3", "loss.name=k1", "rollout.source=offline", f"rollout.offline_file={p}")
    inputs, _ = pairs.check_inputs(c, strict=False)
    f = offline_finding(c, inputs)
    assert f.status == "OK" and "the run's student" in f.detail and "3 passes" in f.detail, f
    hot = cfg("budget.max_steps=3", "loss.name=k1", "rollout.source=offline", f"rollout.offline_file={p}",
              "rollout.temperature=0.7")
    f = offline_finding(hot, inputs)
    assert f.status == "FAIL" and "rollout.temperature" in f.detail, f

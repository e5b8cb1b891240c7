"""One OPD training step, top to bottom: 1. rollout -> 2. teacher scoring -> 3. loss and backward -> 4. update.

``opdkit.train``'s loop calls these four, in this order, once per step (and owns everything around
them: budgets, signals, saves, train.jsonl)::

    batch, reward, lag = step.draw(cfg.loss, inputs, run, sampling, world, i, data_pos, check, ..., seed=cfg.seed, ...)
    scores = step.score_batch(cfg.loss, run.teacher, batch, run.autocast, run.teacher_ctx, rollout=cfg.rollout, ...)
    m, n_tok, n_seq, n_trunc = step.loss_and_backward(cfg.loss, run, world, batch, scores, reward, rollout=..., ...)
    grad_norm, bad, skips = step.update(run, sampling.engine, m, i + 1, skips, log, grad_clip=..., ...)

Each function takes what it reads of the params, not the whole ``Config``: the loss's section first
(``loss``: it decides what the teacher scores and what the loss computes), the other sections or
values by keyword (``rollout``, ``runtime``, ``micro_batch``, ``teacher_names``, ...), the step's data
positionally; so do the functions they call elsewhere (``rewards.attach``, ``schedules.should_stop``,
``opd.alignment_report``, ``opd.check_precision``).

1. **Rollout** (``draw``): P prompts x G samples from the student (the sft control: from the
   teacher, or the reference solutions), laid out with the teacher's view of the same completions
   (``opd.Batch``; a privileged teacher also sees the reference). *Reward branch*: with
   ``loss.reward_weight`` > 0 every completion is graded (``rewards.attach``). The alignment
   self-check (``check_alignment``) runs on the first batch of a start.
2. **Teacher scoring** (``score_batch``): per micro-batch, what the loss needs of the teacher
   (``loss_table.teacher_need``): sampled-token log-probs, top-K, or hidden states and head for the
   full distribution, as ``scores.TeacherScores``. *Several-teachers branch*: a
   ``teachers.TeacherSet`` scores each row with the teacher it names, merged as one teacher's.
3. **Loss and backward** (``loss_and_backward`` -> ``micro_losses`` -> ``chunk_loss``): the
   student's hidden states once with grad per micro-batch, then chunk by chunk over positions
   logits -> the loss function of ``loss_table.LOSSES`` -> backward (only one chunk of (B, C, V)
   logits at a time), then one backward through the decoder. *Several-teachers branch*: the loss
   runs once per teacher on its rows (per-teacher metrics). *Reward branch*: the reward's
   advantage or policy-gradient term (``add_reward``).
4. **Update** (``update``): clip, step the optimizer (unless non-finite: ``guards``), EMA teacher,
   the sampler gets the new weights.

Each function can be called from a notebook on a ``setup.Run``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from opdkit import distributed, guards, loss_table, losses, memory, offline, opd, rewards, teachers
from opdkit.config import BudgetConfig, DataConfig, LossConfig, RolloutConfig, RuntimeConfig, TeacherConfig
from opdkit.data import prompt_indices
from opdkit.engines.base import left_pad
from opdkit.engines.sampling import policy_logits
from opdkit.models import checkpoint_all_but_last
from opdkit.schedules import should_stop
from opdkit.scores import TeacherScores
from opdkit.scoring import completion_hidden, token_logprobs, topk_logprobs, unwrap
from opdkit.setup import Inputs, Run, update_ema
from opdkit.sharding import check_same_on_ranks, deferred_grad_sync, layers_gathered


@dataclass
class Sampling:
    """Who draws a step's samples, built once per start (``opdkit.train``)."""

    engine: object  # the student's sampler (an ``overlap.Lookahead`` around it with rollout.overlap)
    teacher_engine: object | None  # the sft control's sampler (the teacher's), else None
    mine: slice  # this rank's prompts of a step
    reads_logp: bool  # the loss reads the sampler's log-probs (else recorded for the alignment check only)


# --- 1. rollout -------------------------------------------------------------------------------


def step_batch(inputs: Inputs, run: Run, mine: slice, step_i: int, pos: int, *, seed: int, data: DataConfig,
               rollout: RolloutConfig):
    """This rank's examples, prompts and sample seeds of step ``step_i`` (0-based; data rows ``pos`` on):
    P = ``rollout.prompts_per_step`` prompts in ``data.order`` from the params' ``seed``, G =
    ``rollout.samples_per_prompt`` seeds each."""
    P, G = rollout.prompts_per_step, rollout.samples_per_prompt
    rows = prompt_indices(seed, len(inputs.examples), pos, P, data.order, data.hf_order)
    examples = [inputs.examples[i] for i in rows][mine]
    seeds = opd.step_seeds(seed, step_i, len(examples) * G, offset=mine.start * G)
    return examples, run.prompts(examples), seeds


def draw(loss: LossConfig, inputs: Inputs, run: Run, sampling: Sampling, world: distributed.World, step: int,
         data_pos: int, check: bool, elapsed: float, last_step_s: float, save_s: float, *, seed: int,
         data: DataConfig, rollout: RolloutConfig, budget: BudgetConfig, teacher_source: str):
    """Step ``step + 1``'s batch: P prompts x G samples from the student (or the teacher / the
    references for sft; a rank of a sharded run takes prompts mine.start .. mine.stop-1), the
    teacher's view of them, and their rewards (None at λ = 0). With rollout.overlap the batch was
    drawn during the previous step, and the next step's is started here. Returns (batch, reward,
    lag): lag = updates between the weights that drew the batch and those it trains. ``check``: the
    step's alignment check reads the sampling log-probs. ``loss``: who samples
    (``loss_table.samples_from``) and the reward (``rewards.attach``); ``seed``, ``data``, ``rollout``:
    the step's prompts and samples (``step_batch``); ``budget``: whether a next step will run, for
    rollout.overlap (``schedules.should_stop``); ``teacher_source``: ``teacher.source`` (a privileged
    teacher's prompt also holds the reference)."""
    R, G, engine = rollout, rollout.samples_per_prompt, sampling.engine
    pad_id = run.tokenizer.pad_token_id
    examples, prompts, seeds = step_batch(inputs, run, sampling.mine, step, data_pos, seed=seed, data=data, rollout=R)
    lag = 0
    settings = dict(samples_per_prompt=G, temperature=R.temperature, top_p=R.top_p, max_new_tokens=R.max_new_tokens)
    if loss_table.samples_from(loss) == "reference":
        sols = [run.tokenizer(ex.solution, add_special_tokens=False).input_ids for ex in examples]
        ro = opd.reference_rollout(prompts, sols, pad_id, run.tokenizer.eos_token_id, run.device)
    else:
        sampler = sampling.teacher_engine or engine
        with run.autocast():
            ro = sampler.sample(prompts, seeds=seeds, logprobs=sampling.reads_logp or check, **settings)
        if R.overlap:  # start drawing the next step's batch with these weights, if a next step will run
            lag = engine.lag
            if not should_stop(step + 1, elapsed + last_step_s, last_step_s, save_s, budget=budget):
                _, next_prompts, next_seeds = step_batch(inputs, run, sampling.mine, step + 1,
                                                         data_pos + R.prompts_per_step, seed=seed, data=data,
                                                         rollout=R)
                engine.prefetch(next_prompts, seeds=next_seeds, logprobs=sampling.reads_logp, **settings)
    if not teacher_source.startswith("privileged"):  # a teacher model (HF or vLLM) sees the same prompts
        t_ids, t_mask = ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp
    else:  # privileged: the teacher's prompt also holds the reference solution
        priv = [p for p in run.prompts(examples, privileged=True) for _ in range(G)]
        t_ids, t_mask = left_pad(priv, pad_id, run.device)
    batch = opd.Batch(ro, t_ids, t_mask, data.pad_side, teacher_B=run.teacher_rows(examples, G))
    if run.xtok is not None:  # teacher.tokenizer=own: each completion's text re-tokenized by the teacher (opdkit.xtok)
        from opdkit import xtok

        t_prompts = [p for p in run.teacher_prompts(examples) for _ in range(G)]
        batch.xtok = xtok.teacher_view(run.xtok, ro.completion_ids_B_T, ro.completion_mask_B_T, t_prompts)
    # --- reward branch: OPD plus a verifiable reward: every completion graded against its row's answer (None at λ = 0)
    reward = rewards.attach(loss, batch, run.tokenizer, examples, world, f"data file {inputs.train_path}",
                            samples_per_prompt=G)
    return batch, reward, lag


def alignment_due(step: int, first_step: int, *, runtime: RuntimeConfig) -> bool:
    """Whether step ``step + 1`` runs the alignment check (``runtime.alignment_check``): the first batch
    of every start (``first_step``), and with ``runtime.alignment_every`` = N > 0 every N-th step too."""
    every = runtime.alignment_every
    return runtime.alignment_check and (step == first_step or bool(every and (step + 1) % every == 0))


def check_alignment(loss: LossConfig, run: Run, batch: opd.Batch, lag: int, step: int, log, *,
                    rollout: RolloutConfig, runtime: RuntimeConfig, teacher_source: str, engine: str) -> dict | None:
    """On the first batch of a start (and every ``runtime.alignment_every`` steps): the sampler's
    log-probs against the loss's recomputation (``opd.alignment_report``; ``AlignmentError`` stops
    the run). The report, or None if not run (a batch drawn ahead, an offline pool's, or not the
    student's: ``rollout.source`` / ``offline_ratio``, ``loss``). ``teacher_source``: ``teacher.source``;
    ``engine``: the sampler's engine (``engines.select.engine_name``), for the precision the check
    allows (``opd.check_precision``, with ``rollout.static_cache``)."""
    align = None
    if lag:
        log(f"alignment check skipped at step {step + 1}: its batch was drawn (rollout.overlap=1) by the weights one "
            "update before the current ones; it ran on the run's first batch")
    elif rollout.source == "offline" and not (
            step == 0 and rollout.offline_ratio == "behaviour"
            and offline.behaviour_is_student(run.teacher, run.inputs.student_path)):
        log("alignment check skipped: the offline pool's samples were drawn by its policy, not by these weights "
            "(it runs at step 0 of a run whose student is the pool's policy, rollout.offline_ratio=behaviour)")
    elif loss_table.samples_from(loss) == "student":
        precision = opd.check_precision(run.dtype, run.device, engine=engine, static_cache=rollout.static_cache)
        with run.autocast():  # recomputed as the loss recomputes them
            align = opd.alignment_report(loss, batch, run.student, precision, rollout=rollout, runtime=runtime,
                                         teacher_source=teacher_source)
    if align and batch.xtok is not None:  # the teacher's own view: its layout, and how the two tokenizations align
        from opdkit import xtok
        from opdkit.scoring import check_alignment as check_layout

        view = batch.xtok.teacher
        g = opd.GEOMETRIES["left"](view.prompt_ids_B_Sp, view.prompt_mask_B_Sp, view.completion_ids_B_T,
                                   view.completion_mask_B_T)
        t = check_layout(g, view.completion_ids_B_T, view.completion_mask_B_T, view.prompt_mask_B_Sp)
        align |= {f"teacher_view_{k}": v for k, v in t.items()} | xtok.span_stats(batch.xtok)
    if align:
        log(f"alignment check passed at step {step + 1}: {align}")
    return align


# --- 2. teacher scoring ----------------------------------------------------------------------


def micro_slices(batch: opd.Batch, micro_batch: int) -> list[slice]:
    """The step's micro-batches: ``micro_batch`` rows each (``optim.micro_batch``; 0: one of all B rows)."""
    B = batch.rollout.completion_ids_B_T.shape[0]
    mb = micro_batch or B
    return [slice(s, min(B, s + mb)) for s in range(0, B, mb)]


def score_batch(loss: LossConfig, teacher, batch: opd.Batch, autocast, teacher_ctx_manager=contextlib.nullcontext, *,
                rollout: RolloutConfig, runtime: RuntimeConfig, micro_batch: int) -> list:
    """Teacher scoring of every micro-batch of the step (no grad): ``teacher_context`` of each of
    ``micro_slices(batch, micro_batch)``, what loss ``loss`` needs at rollout settings ``rollout``
    (``loss_table.teacher_need``). ``teacher``: an HF model, a ``teachers.TeacherSet`` (each row
    scored by the teacher it names) or a teacher that scores elsewhere (``engines.vllm_teacher``: one
    call for the step's rows). ``runtime``: ``logprob_chunk`` and ``unpadded_rows`` of the teacher's pass."""
    slices = micro_slices(batch, micro_batch)
    with autocast():
        if batch.xtok is not None:  # teacher.tokenizer=own: the teacher scores its own tokens, moved onto the student's
            from opdkit import xtok_loss

            t_view = batch.xtok.teacher
            view = opd.Batch(t_view, t_view.prompt_ids_B_Sp, t_view.prompt_mask_B_Sp)
            scored = score_rows(loss, teacher, view, slices, teacher_ctx_manager, rollout=rollout, runtime=runtime)
            return [xtok_loss.to_student(ctx, batch.xtok, rows) for ctx, rows in zip(scored, slices)]
        return score_rows(loss, teacher, batch, slices, teacher_ctx_manager, rollout=rollout, runtime=runtime)


@torch.no_grad()
def score_rows(loss: LossConfig, teacher, batch: opd.Batch, row_sets: list,
               teacher_ctx_manager=contextlib.nullcontext, *, rollout: RolloutConfig,
               runtime: RuntimeConfig) -> list:
    """``teacher_context`` of each of ``row_sets`` (slices or index tensors of the batch's rows). A
    sharded teacher scoring row by row (``runtime.unpadded_rows``) gathers each layer once per row
    set, not once per row. A teacher that scores elsewhere gets one call, ``teacher.score(k, batch,
    row_sets)``: k = ``loss.topk`` where the loss reads the teacher's top-K, else 0 (sampled tokens only)."""
    need = loss_table.teacher_need(loss, rollout)
    if need == "none":
        return [None] * len(row_sets)
    if isinstance(teacher, teachers.TeacherSet):  # --- several teachers: each scores the rows naming it
        subsets = teachers.split_rows(batch, row_sets, len(teacher.members))
        per_teacher = {i: score_rows(loss, member, batch, [idx for idx in sub if idx.numel()], teacher_ctx_manager,
                                     rollout=rollout, runtime=runtime)
                       for i, (member, sub) in enumerate(zip(teacher.members, subsets))}
        return teachers.merge(batch, row_sets, per_teacher)
    if not isinstance(teacher, torch.nn.Module):
        return teacher.score(loss.topk if need == "topk" else 0, batch, row_sets)
    gather_once = layers_gathered if runtime.unpadded_rows else contextlib.nullcontext  # rows run one by one
    out = []
    for rows in row_sets:
        with gather_once(teacher):
            out.append(teacher_context(loss, teacher, batch, rows, teacher_ctx_manager, rollout=rollout,
                                       runtime=runtime))
    return out


@torch.no_grad()
def teacher_context(loss: LossConfig, teacher, batch: opd.Batch, rows: slice,
                    teacher_ctx_manager=contextlib.nullcontext, *, rollout: RolloutConfig,
                    runtime: RuntimeConfig) -> TeacherScores | None:
    """What loss ``loss`` needs from the teacher for micro-batch ``rows`` at rollout settings
    ``rollout`` (``loss_table.teacher_need``; None if nothing): sampled-token log-probs always, plus
    the top-K (K = ``loss.topk``) or the hidden states (full). For ``recorded`` (sft on samples the
    teacher drew at temperature 1, top-p 1) the log-probs are the ones the rollout recorded, with no
    teacher pass. A teacher on another device (``teacher.device``) scores there; its outputs come to
    the batch's. ``runtime``: ``unpadded_rows`` (row by row) and ``logprob_chunk`` (positions per
    log-softmax chunk)."""
    need = loss_table.teacher_need(loss, rollout)
    if need == "none":
        return None
    ro = batch.rollout
    if need == "recorded":
        return TeacherScores(ro.sampling_logp_B_T[rows])
    t_dev = teachers.device_of(teacher)
    with teacher_ctx_manager():
        _, head = unwrap(teacher)
        h_B_T_H = completion_hidden(teacher, opd.teacher_geometry(batch, rows).to(t_dev), runtime.unpadded_rows)
        ids_B_T = ro.completion_ids_B_T[rows].to(t_dev)
        ctx = TeacherScores(token_logprobs(head, h_B_T_H, ids_B_T, runtime.logprob_chunk), head=head)
        if need == "topk":
            ctx.topk_ids_B_T_K, ctx.topk_logp_B_T_K = topk_logprobs(head, h_B_T_H, loss.topk, runtime.logprob_chunk)
        elif need == "full":
            ctx.hidden_B_T_H = h_B_T_H
    return teachers.to_device(ctx, teacher, ro.completion_ids_B_T.device)


# --- 3. loss and backward --------------------------------------------------------------------


def loss_and_backward(loss: LossConfig, run: Run, world: distributed.World, batch: opd.Batch, contexts, reward, *,
                      rollout: RolloutConfig, runtime: RuntimeConfig, micro_batch: int,
                      teacher_names: tuple[str, ...], vocab_map: str):
    """Loss + backward, micro-batched, as a token mean over the whole step (FSDP averages gradients
    over ranks, hence / world.size): ``micro_losses`` (its arguments: ``loss`` and the keywords), then
    the metrics reduced over ranks, per teacher of ``teacher_names`` (the names of ``teachers``; ()
    with one teacher) and with the reward's (``reward``: ``rewards.attach``'s sums, None at λ = 0).
    Returns (metrics, tokens, sequences, truncated sequences), the counts summed over ranks."""
    ro = batch.rollout
    n_tok, n_seq, n_trunc = world.sum(ro.n_tokens, ro.completion_ids_B_T.shape[0], int(ro.truncated_B.sum()))
    unchecked = runtime.unchecked_layers_memory if runtime.grad_checkpointing and world.size == 1 else 0.0
    m = micro_losses(loss, run.student, batch, contexts, run.autocast, n_tokens=n_tok / world.size, rollout=rollout,
                     runtime=runtime, micro_batch=micro_batch, teacher_names=teacher_names, vocab_map=vocab_map,
                     unchecked_memory=unchecked)
    m.update(opd.pad_offsets(batch))  # data.pad_side=right: the measured offsets (the released defect's size)
    m = distributed.reduce_metrics(m, world)
    m = rewards.finish_metrics(reward, teachers.finish_metrics(m, teacher_names))
    return m, n_tok, n_seq, n_trunc


def micro_losses(loss: LossConfig, student, batch: opd.Batch, contexts: list, autocast,
                 n_tokens: float | None = None, *, rollout: RolloutConfig, runtime: RuntimeConfig, micro_batch: int,
                 teacher_names: tuple[str, ...] = (), vocab_map: str = TeacherConfig.vocab_map,
                 unchecked_memory: float = 0.0) -> dict:
    """Forward + backward of the whole step in micro-batches (``micro_slices(batch, micro_batch)``)
    through loss ``loss`` (``chunk_loss``); returns combined metrics.

    ``contexts`` are ``score_batch``'s per-micro-batch teacher outputs. Gradients accumulate in
    ``student``'s parameters; the loss is the token mean over the whole step (every micro-batch
    divides by the step's token count). ``n_tokens`` overrides that count: a rank of a sharded run
    holds part of the step and passes the global count / world size (FSDP averages over ranks).

    Per micro-batch: the decoder's forward with grad (row by row with ``runtime.unpadded_rows``),
    then each position chunk's head -> loss -> backward on a detached copy of the hidden states,
    then one backward through the decoder with the accumulated hidden-state gradient. On a sharded
    student that structure issues the same collectives on every rank, whatever its completion
    lengths: the chunk backwards run under ``deferred_grad_sync`` (the head's gradient accumulates
    where the root is gathered; no collective, however many chunks a rank's T makes), and the
    decoder's backward reduce-scatters every gradient, the head's included, once; row by row, each
    layer is gathered once for all rows (``layers_gathered``). Per micro-batch that is one
    all-gather of the root, two of each layer (forward, backward) and one reduce-scatter of each
    unit with trainable parameters.

    The settings: ``rollout`` (the student policy the loss differentiates: ``loss_table.update_policy``),
    ``runtime`` (``logprob_chunk``: positions per chunk; ``unpadded_rows``), ``micro_batch``
    (``optim.micro_batch``), ``teacher_names`` (the names of ``teachers``, in order, whose rows
    ``Batch.teacher_B`` numbers; () with one teacher), ``vocab_map`` (``teacher.vocab_map``, read
    with ``teacher.tokenizer=own`` and a full-distribution loss) and ``unchecked_memory``
    (``runtime.unchecked_layers_memory`` for a checkpointed student: ``uncheck_layers``, whose plan the
    metrics report as ``unchecked_layers_max`` / ``matmul_layers_max``; 0: leave its layers as they are).
    """
    ro = batch.rollout
    n_tokens = max(1.0, float(ro.completion_mask_B_T.sum()) if n_tokens is None else n_tokens)
    chunk = runtime.logprob_chunk
    gather_once = layers_gathered if runtime.unpadded_rows else contextlib.nullcontext  # rows run one by one
    parts, total, plans = [], 0.0, []
    _, s_head = unwrap(student)
    slices = micro_slices(batch, micro_batch)
    check_same_on_ranks(student, len(slices), "micro-batches")
    for rows, t_ctx in zip(slices, contexts):
        g = opd.student_geometry(batch, rows)
        with autocast(), gather_once(student):
            if unchecked_memory > 0:  # the layer plan, as train.jsonl's unchecked_layers_max / matmul_layers_max
                plans.append(uncheck_layers(student, g, unchecked_memory, runtime.unpadded_rows,
                                            keep_attention=runtime.checkpoint_keep_attention, chunk=chunk,
                                            keep_matmuls=runtime.checkpoint_keep_matmuls))
            h_B_T_H = completion_hidden(student, g, runtime.unpadded_rows)
        h_leaf = h_B_T_H.detach().requires_grad_(True)
        if t_ctx is not None and t_ctx.cross_tokenizer:  # teacher.tokenizer=own: t~ of merged spans' tokens
            from opdkit import xtok_loss  # (a no-grad pass of the head, the root still gathered: no collective)

            with autocast():
                t_ctx = xtok_loss.with_student_rest(t_ctx, s_head, h_leaf, batch.rollout.completion_ids_B_T[rows],
                                                    chunk, *loss_table.update_policy(loss, rollout))
        with deferred_grad_sync(student):
            for s in range(0, h_leaf.shape[1], chunk):
                sl = slice(s, s + chunk)
                with autocast():
                    loss_C, m = chunk_loss(loss, h_leaf[:, sl], s_head, t_ctx, sl, batch, rows, n_tokens,
                                           rollout=rollout, teacher_names=teacher_names, vocab_map=vocab_map)
                loss_C.backward()  # into h_leaf.grad and the head's parameters; frees this chunk's logits
                total += float(loss_C.detach())
                parts.append(m)
        with gather_once(student):
            h_B_T_H.backward(h_leaf.grad)  # through the decoder, once per micro-batch: gradients reduced here
    out = combine(parts)
    out["loss"] = total
    if plans:
        out["unchecked_layers_max"] = max(n for n, _ in plans)
        out["matmul_layers_max"] = max(k for _, k in plans)
    return out


def uncheck_layers(student, g, share: float, unpadded: bool, *, keep_attention: bool, chunk: int,
                   keep_matmuls: bool = False) -> tuple[int, int]:
    """Before a checkpointed ``student``'s forward over geometry ``g``: how its layers spend ``share`` of the GPU
    memory that the update would leave free with every layer checkpointed (free now, less
    ``memory.checkpointed_update_bytes``: gradients, checkpointed activations with ``keep_attention``, one logits
    chunk of ``chunk`` positions), at this micro-batch's tokens (``g``'s real tokens when ``unpadded`` rows run
    pads removed, else every position): with ``keep_matmuls`` (runtime.checkpoint_keep_matmuls) as many layers as
    fit keep their projections' outputs and of those as many as the rest allows run unchecked
    (``memory.layer_plan``), else only unchecked layers, as many as fit; the others checkpointed
    (``models.checkpoint_all_but_last``). The same gradients. Returns (unchecked, keeping their matmuls).
    ``keep_matmuls`` applies to a fully trained student only: with adapters (LoRA) on a frozen base each adapted
    projection also keeps its adapter's outputs, one as wide as its own, which ``memory.kept_matmul_bytes`` does not
    count (the layers would take about twice the memory the plan counted)."""
    decoder, _ = unwrap(student)
    param = next(decoder.parameters())
    compute_bytes = 2 if torch.is_autocast_enabled(param.device.type) else param.element_size()
    s = memory.shape_of(student)
    keep_matmuls = keep_matmuls and s.trainable == s.params  # no frozen base under adapters
    tokens = int(g.attention_mask_B_S.sum()) if unpadded else g.input_ids_B_S.numel()
    reserve = memory.checkpointed_update_bytes(s, tokens, g.input_ids_B_S.shape[0], min(chunk, g.completion_len),
                                               compute_bytes, keep_attention)
    budget = int(share * max(0, memory.free_device_bytes(param.device) - reserve))
    layer = memory.layer_activation_bytes(s.hidden, s.kv, s.intermediate, compute_bytes)
    kept = memory.kept_matmul_bytes(s.hidden, s.kv, s.intermediate, compute_bytes) if keep_matmuls else 0
    n, k = memory.layer_plan(budget, tokens, layer, kept, len(decoder.layers))
    checkpoint_all_but_last(decoder.layers, n, k)
    return n, k


def chunk_loss(L: LossConfig, h_s_B_C_H, s_head, t_ctx, sl, batch: opd.Batch, rows: slice, n_tokens: float, *,
               rollout: RolloutConfig, teacher_names: tuple[str, ...] = (),
               vocab_map: str = TeacherConfig.vocab_map):
    """Loss and metrics of positions ``sl`` of micro-batch ``rows``: loss config ``L``'s declared inputs
    (``opdkit.loss_table``) made for this chunk, then its function (with several teachers, once per
    teacher of ``teacher_names`` on its rows: the per-teacher metrics); plus the reward's term
    (``opdkit.rewards``). ``h_s_B_C_H``: the student's hidden states of the chunk; ``rollout``: the
    policy's temperature and top-p (``loss_table.update_policy``); ``vocab_map``: ``teacher.vocab_map``
    (cross-tokenizer full-distribution losses)."""
    spec = loss_table.spec(L.name)
    ro = batch.rollout
    ids_B_C = ro.completion_ids_B_T[rows, sl]
    # the student policy the loss differentiates (loss_table.update_policy): tempered, top-p-truncated
    logits_B_C_V = policy_logits(s_head(h_s_B_C_H).float(), *loss_table.update_policy(L, rollout))

    def teacher_full_B_C_V():
        with torch.no_grad():
            return teachers.teacher_full_logprobs(t_ctx, sl)

    make = {
        "logp_B_T": lambda: logits_B_C_V.log_softmax(-1).gather(-1, ids_B_C[..., None])[..., 0],
        "old_logp_B_T": lambda: opd.recorded_logp(ro)[rows, sl],
        "teacher_logp_B_T": lambda: t_ctx.logp_B_T[:, sl],
        "logits_B_T_V": lambda: logits_B_C_V,
        "teacher_logp_B_T_V": teacher_full_B_C_V,
        "topk_ids_B_T_K": lambda: t_ctx.topk_ids_B_T_K[:, sl],
        "topk_logp_B_T_K": lambda: t_ctx.topk_logp_B_T_K[:, sl],
        "mask_B_T": lambda: ro.completion_mask_B_T[rows, sl],
        "n_tokens": lambda: n_tokens,
    }
    reward_B_C = None
    if batch.reward_adv_B is not None:  # --- reward branch: λ A_b on every token of row b
        reward_B_C = (L.reward_weight * batch.reward_adv_B[rows])[:, None].expand(ids_B_C.shape)
    kwargs = spec.params(L) | ({"reward_adv_B_T": reward_B_C} if reward_B_C is not None and spec.reward == "advantage"
                               else {})
    groups = teachers.row_groups(teacher_names, batch, rows)  # None: one teacher for every row
    on_student = loss_table.samples_from(L) == "student"
    xtok = t_ctx is not None and t_ctx.cross_tokenizer  # teacher.tokenizer=own (opdkit.xtok_loss)
    if xtok and spec.teacher == "full":
        from opdkit import xtok_loss

        proj = xtok_loss.make_projection(batch.xtok.pair, vocab_map, logits_B_C_V.device)
        loss, m = xtok_loss.full_loss(L.name, logits_B_C_V, teacher_full_B_C_V(), make["logp_B_T"](),
                                      make["teacher_logp_B_T"](), t_ctx.xtok_one_B_T[:, sl],
                                      t_ctx.xtok_len_B_T[:, sl], make["mask_B_T"](), n_tokens, proj, **kwargs)
    elif groups is None:
        loss, m = spec.function(*(make[name]() for name in spec.inputs), **kwargs)
        fill_kl(m, on_student, logits_B_C_V, ids_B_C, t_ctx, sl, make["mask_B_T"]())
    else:  # --- several teachers: each teacher's rows through the loss on their own (the same sum; metrics per teacher)
        vals = {name: make[name]() for name in spec.inputs}
        loss, parts = None, {}
        for name, idx_b in groups.items():
            part, m_t = spec.function(*(_rows(vals[n], idx_b) for n in spec.inputs),
                                      **{k: _rows(v, idx_b) for k, v in kwargs.items()})
            fill_kl(m_t, on_student, logits_B_C_V[idx_b], ids_B_C[idx_b], t_ctx, sl, make["mask_B_T"]()[idx_b], idx_b)
            loss = part if loss is None else loss + part
            parts[name] = (m_t, float(part.detach()) * n_tokens)
        m = teachers.chunk_metrics(combine([m_t for m_t, _ in parts.values()]), parts)
    if xtok:
        from opdkit import xtok_loss

        m = xtok_loss.chunk_metrics(m, t_ctx, sl, make["logp_B_T"](), make["mask_B_T"](), spec.teacher != "full")
    if reward_B_C is not None:  # --- reward branch
        loss, m = add_reward(L, spec, loss, m, make, reward_B_C, t_ctx, sl)
    return loss, m


def _rows(x, idx_b):
    """Rows ``idx_b`` of a tensor input (a number, e.g. ``n_tokens``, as it is)."""
    return x[idx_b] if torch.is_tensor(x) else x


def fill_kl(m: dict, on_student: bool, logits_B_C_V, ids_B_C, t_ctx, sl, mask_B_C, idx_b=None) -> None:
    """A loss that reports no ``kl`` (top-K, sft): the sampled estimate on the scored tokens (``on_student``:
    the student's samples, the reverse KL; else the teacher's, the forward KL)."""
    if "kl" in m or t_ctx is None:
        return
    t_B_C = t_ctx.logp_B_T[:, sl] if idx_b is None else t_ctx.logp_B_T[idx_b, sl]
    s_B_C = logits_B_C_V.detach().log_softmax(-1).gather(-1, ids_B_C[..., None])[..., 0]
    d_B_C = s_B_C - t_B_C  # student samples: reverse KL; teacher samples: minus forward KL
    sign = 1.0 if on_student else -1.0
    m["kl"] = float(sign * (d_B_C * mask_B_C).sum() / mask_B_C.sum().clamp_min(1))


def add_reward(L, spec, loss, m: dict, make: dict, reward_B_C, t_ctx, sl):
    """The reward's part of a chunk (``opdkit.rewards``): for a loss with ``reward="term"`` its
    policy-gradient term added to the loss; for every loss the metrics of the reward's share of the
    per-token advantage (mean |λ A| and mean |log p_T - log p_S| over the scored tokens). ``L``: the loss config."""
    logp_B_C, mask_B_C = make["logp_B_T"](), make["mask_B_T"]()
    if spec.reward == "term":
        term, _ = losses.reward_pg_loss(logp_B_C, make["old_logp_B_T"](), reward_B_C, mask_B_C, make["n_tokens"](),
                                        L.clip_eps, dual_clip=L.dual_clip)
        loss = loss + term
    with torch.no_grad():
        keep_B_C = (mask_B_C != 0) & torch.isfinite(logp_B_C)
        n = keep_B_C.sum().clamp_min(1)
        d_B_C = torch.where(keep_B_C, t_ctx.logp_B_T[:, sl] - logp_B_C, torch.zeros_like(logp_B_C))
        r_B_C = torch.where(keep_B_C, reward_B_C, torch.zeros_like(reward_B_C))
        m = m | {"reward_adv_abs": float(r_B_C.abs().sum() / n), "teacher_adv_abs": float(d_B_C.abs().sum() / n)}
    return loss, m


def combine(parts: list[dict]) -> dict:
    """Token-weighted means of chunk metrics (``tokens`` summed, ``*_max`` maxed)."""
    total = sum(p.get("tokens", 0.0) for p in parts)
    out: dict = {"tokens": total}
    for key in {k for p in parts for k in p} - {"tokens"}:
        vals = [(p[key], p.get("tokens", 0.0)) for p in parts if key in p and p[key] is not None]
        if key.endswith("_max"):
            out[key] = max(v for v, _ in vals) if vals else None
        else:
            out[key] = sum(v * w for v, w in vals) / total if total else None
    return out


# --- 4. update --------------------------------------------------------------------------------


def update(run: Run, engine, m: dict, step_no: int, skips: int, log, *, grad_clip: float, on_nonfinite: str,
           max_skips: int, ema_decay: float):
    """Clip the gradients and step the optimizer, unless the loss or gradient norm is non-finite
    (``guards.stop_or_skip``: raises under runtime.on_nonfinite=stop or after too many skips; else
    the update is dropped); then check the parameters, update the EMA teacher, sync the sampler.
    Returns (grad_norm, the non-finite names or an empty list, consecutive skips). ``grad_clip``:
    optim.grad_clip (<= 0: none); ``on_nonfinite`` / ``max_skips``: runtime.on_nonfinite /
    runtime.max_nonfinite_skips; ``ema_decay``: teacher.ema_decay."""
    trainable = [p for p in run.student.parameters() if p.requires_grad]
    grad_norm = distributed.clip_grad_norm_(trainable, grad_clip if grad_clip > 0 else float("inf"))
    # loss and norm are global (reduced over ranks): every rank takes the same decision
    bad = guards.nonfinite_values(loss=m["loss"], grad_norm=grad_norm)
    skips = skips + 1 if bad else 0
    if bad:
        guards.stop_or_skip(bad, {"loss": m["loss"], "grad_norm": grad_norm}, step_no, skips,
                            on_nonfinite, max_skips)
        run.optimizer.zero_grad(set_to_none=True)
        log(f"step {step_no}: non-finite {', '.join(bad)}; update skipped ({skips} in a row)")
    else:
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        guards.check_parameters(trainable, step_no)
        if run.ema is not None:
            update_ema(run.ema, run.student, ema_decay)
        engine.sync_weights(run.student)  # a separate inference engine (vLLM) samples the new weights
    return grad_norm, bad, skips

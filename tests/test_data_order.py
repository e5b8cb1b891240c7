"""``data.order=hf_trainer``: the rows a Hugging Face ``Trainer`` feeds each step, checked against
transformers' and accelerate's own code on a synthetic table: a real ``Trainer``'s train dataloader
(one process, two epochs), and accelerate's ``prepare_data_loader`` dealing four processes their
batches, each process's torch seed as the released OPSD trainer leaves it (its colocated vLLM engine
reseeds torch with the process index) or as a Trainer alone leaves it (the params' seed)."""

from __future__ import annotations

import warnings

import pytest
import torch

from opdkit.config import config_from_dict
from opdkit.data import hf_trainer_rows
from opdkit.train import prompt_indices


class _Nothing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, **kw):
        return {"loss": self.w.sum()}


def _collate(features):
    return {"idx": torch.tensor([f["idx"] for f in features])}


def test_one_process_is_the_trainers_own_dataloader_epoch_after_epoch(tmp_path):
    """A real Trainer (seed 42, 5 rows a batch, 2 accumulation steps): its train dataloader's indices over
    two epochs, each started as Trainer.train starts it (set_epoch), are the stream's first 10 steps."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    n, b, a, seed = 50, 5, 2, 42
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=b, gradient_accumulation_steps=a,
                             seed=seed, report_to=[], use_cpu=True, remove_unused_columns=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=_Nothing(), args=args, train_dataset=Dataset.from_dict({"idx": list(range(n))}),
                          data_collator=_collate)
    dl = trainer.get_train_dataloader()
    got = []
    for epoch in range(2):  # as Trainer._inner_training_loop starts an epoch
        dl.set_epoch(epoch)
        inner = getattr(getattr(dl, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        got += [i for batch in dl for i in batch["idx"].tolist()]
    P = b * a
    want = [i for s in range(2 * n // P) for i in hf_trainer_rows(seed, n, s * P, P, device_batch=b)]
    assert got == want and got[:n] != list(range(n)) and got[:n] != got[n:]  # shuffled, reshuffled per epoch
    assert sorted(got[:n]) == list(range(n))
    # opdkit's loop asks prompt_indices for a step's rows
    cfg = config_from_dict({"data": {"order": "hf_trainer", "hf_order": {"device_batch": b}}})
    assert prompt_indices(seed, n, 3 * P, P, cfg.data.order, cfg.data.hf_order) == want[3 * P:4 * P]


@pytest.mark.parametrize("rank_seeds", ["seed", "vllm_rank"])
def test_four_processes_are_dealt_their_batches_as_accelerate_deals_them(rank_seeds):
    """accelerate's prepare_data_loader on each of 4 processes (1 row a batch, 2 accumulation steps: a
    step is 8 rows), each process's torch seed 42 (a Trainer alone) or its index (the released trainer's
    vLLM engine): a step's rows are micro-batch j of every process in turn."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, RandomSampler

    W, b, a, n = 4, 1, 2, 40
    P = W * b * a
    table = list(range(n))
    per_process = []
    for r in range(W):
        torch.manual_seed(42 if rank_seeds == "seed" else r)  # torch's initial seed when the dataloader is made
        dl = prepare_data_loader(DataLoader(table, batch_size=b, sampler=RandomSampler(table)), num_processes=W,
                                 process_index=r, put_on_device=False, use_seedable_sampler=True)
        dl.set_epoch(0)
        per_process.append([batch.tolist() for batch in dl])
    got = [[i for j in range(a) for r in range(W) for i in per_process[r][s * a + j]] for s in range(n // P)]
    want = [hf_trainer_rows(42, n, s * P, P, W, b, rank_seeds) for s in range(n // P)]
    assert got == want
    flat = [i for step in want for i in step]
    if rank_seeds == "seed":  # one order, dealt round the processes: each row once an epoch
        assert sorted(flat) == table
    else:  # four independent orders: rows repeat across processes within an epoch
        assert len(set(flat)) < n


def test_a_step_that_is_not_whole_micro_batches_is_refused():
    with pytest.raises(ValueError, match="whole number of micro-batches"):
        hf_trainer_rows(0, 100, 0, 10, processes=4, device_batch=1)
    with pytest.raises(ValueError, match="step boundary"):
        hf_trainer_rows(0, 100, 5, 10)

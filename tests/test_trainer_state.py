"""The trainer state (opdkit.trainer_state): a saved and restored run is the run it was, bit for
bit (weights, optimizer, EMA teacher, RNG), and continues identically; a failed write is retried
or leaves the previous state as it was; an older version's single file is still read.

The reference is the live run itself: its tensors are compared with ``torch.equal`` against a
fresh run that restored the state.
"""

from __future__ import annotations

import errno

import pytest
import torch

from opdkit import trainer_state
from opdkit.config import load_config
from opdkit.fsutil import StorageError
from opdkit.setup import build_run, prepare_inputs, trainable_state
from opdkit.teacher import unwrap

BASE = ["runtime.threads=1", "budget.max_steps=4", "optim.lr=0.01", "optim.warmup_steps=0", "optim.schedule=constant",
        "publish.backoff_s=0"]
VARIANTS = {"full": [], "lora": ["lora.enabled=true", "lora.r=4"], "ema": ["teacher.source=privileged_ema"]}


def _run(*overrides: str):
    cfg = load_config(None, [*BASE, *overrides])
    run = build_run(cfg, prepare_inputs(cfg), log=lambda *_: None)
    run.extras["lr_clock_start_s"] = 1.5
    return run


def _step(run) -> None:
    """One update of the student (a token loss through the decoder and head) and of the EMA teacher."""
    from opdkit.setup import update_ema

    decoder, head = unwrap(run.student)
    ids = torch.randint(3, 30, (2, 7))  # draws from the RNG, so a restored RNG matters
    logp = head(decoder(input_ids=ids, use_cache=False).last_hidden_state).float().log_softmax(-1)
    (-logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()).backward()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema is not None:
        update_ema(run.ema, run.student, 0.9)


def _assert_same(a, b) -> None:
    wa, wb = trainable_state(a.student), trainable_state(b.student)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
    for i, s in oa["state"].items():
        assert s.keys() == ob["state"][i].keys() and all(torch.equal(v, ob["state"][i][k]) for k, v in s.items())
    if a.ema is not None:
        ea, eb = a.ema.state_dict(), b.ema.state_dict()
        assert all(torch.equal(ea[k], eb[k]) for k in ea)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_restored_run_is_the_saved_run_and_continues_bit_for_bit(tmp_path, variant):
    live = _run(*VARIANTS[variant])
    for _ in range(2):
        _step(live)
    path = trainer_state.save(tmp_path, live, step=2, elapsed=12.5, data_pos=8, log=lambda *_: None)
    assert path == tmp_path / "state" / "trainer_state-2" and trainer_state.find(tmp_path) == path
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["trainer_state-2"]  # no temporary left

    state = trainer_state.peek(tmp_path)
    assert (state["step"], state["elapsed_s"], state["data_pos"], state["lr_clock_start_s"]) == (2, 12.5, 8, 1.5)
    torch.manual_seed(99)  # the restored RNG, not this one, drives what follows
    resumed = _run(*VARIANTS[variant])
    trainer_state.restore(resumed, state)
    _assert_same(live, resumed)
    assert torch.equal(torch.get_rng_state(), state["rng"])
    torch.set_rng_state(state["rng"])  # the live run continues from the same RNG state
    _step(live)
    torch.set_rng_state(state["rng"])
    _step(resumed)
    _assert_same(live, resumed)


def test_the_tied_head_is_stored_once_and_restored_with_the_embedding(tmp_path):
    live = _run()
    base = live.student
    assert base.lm_head.weight is base.model.embed_tokens.weight  # the shipped student ties them
    _step(live)
    trainer_state.save(tmp_path, live, step=1, elapsed=0.0, data_pos=0, log=lambda *_: None)
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(trainer_state.find(tmp_path)).read_metadata().state_dict_metadata)
    assert "model.model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys
    resumed = _run()
    trainer_state.restore(resumed, trainer_state.peek(tmp_path))
    assert resumed.student.lm_head.weight is resumed.student.model.embed_tokens.weight
    _assert_same(live, resumed)


def test_a_transient_write_error_is_retried_and_a_new_state_replaces_the_old(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    live = _run()
    _step(live)
    trainer_state.save(tmp_path, live, step=1, elapsed=0.0, data_pos=4, log=lambda *_: None)
    real, calls = fs._write_item, []

    def flaky(*a, **k):  # the NFS server went away for a moment, in the middle of the tensors
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(*a, **k)

    monkeypatch.setattr(fs, "_write_item", flaky)
    _step(live)
    logs: list[str] = []
    path = trainer_state.save(tmp_path, live, step=2, elapsed=1.0, data_pos=8, log=logs.append)
    assert any("transient I/O error while saving the trainer state at step 2" in ln for ln in logs)
    assert [p.name for p in (tmp_path / "state").iterdir()] == [path.name] == ["trainer_state-2"]
    resumed = _run()
    trainer_state.restore(resumed, trainer_state.peek(tmp_path))
    _assert_same(live, resumed)


def test_a_read_only_file_system_is_not_retried_and_the_previous_state_stays(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    live = _run()
    _step(live)
    trainer_state.save(tmp_path, live, step=1, elapsed=0.0, data_pos=4, log=lambda *_: None)
    calls = []

    def erofs(*a, **k):
        calls.append(1)
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(fs, "_write_item", erofs)
    _step(live)
    with pytest.raises(StorageError, match=r"state is on a read-only file system: the trainer state at step 2 needs"):
        trainer_state.save(tmp_path, live, step=2, elapsed=1.0, data_pos=8, log=lambda *_: None)
    assert len(calls) == 1  # not retried
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["trainer_state-1"] and trainer_state.peek(tmp_path)["step"] == 1


def test_a_second_save_of_one_step_gets_a_new_name_and_is_the_one_resumed(tmp_path):
    live = _run()
    _step(live)
    trainer_state.save(tmp_path, live, step=1, elapsed=1.0, data_pos=4, log=lambda *_: None)
    again = trainer_state.save(tmp_path, live, step=1, elapsed=2.0, data_pos=4, log=lambda *_: None)
    assert again.name == "trainer_state-1.1" and [p.name for p in (tmp_path / "state").iterdir()] == [again.name]
    assert trainer_state.peek(tmp_path)["elapsed_s"] == 2.0


def test_an_older_versions_single_file_is_read_then_replaced(tmp_path):
    live = _run()
    _step(live)
    legacy = {  # what opdkit wrote before the streaming state: one torch.save of everything
        "step": 1, "elapsed_s": 3.0, "data_pos": 4, "lr_clock_start_s": 1.5,
        "model": trainable_state(live.student), "optimizer": live.optimizer.state_dict(), "ema": None,
        "rng": torch.get_rng_state(), "rng_cuda": None, "config": {}, "data_fingerprint": live.inputs.data_fingerprint,
    }  # fmt: skip
    (tmp_path / "state").mkdir()
    torch.save(legacy, tmp_path / "state" / "trainer_state.pt")
    state = trainer_state.peek(tmp_path)
    assert (state["format"], state["step"], state["path"].name) == (1, 1, "trainer_state.pt")
    resumed = _run()
    trainer_state.restore(resumed, state)
    _assert_same(live, resumed)
    trainer_state.save(tmp_path, resumed, step=2, elapsed=4.0, data_pos=8, log=lambda *_: None)
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["trainer_state-2"]


def test_a_damaged_state_is_refused_with_what_to_do(tmp_path):
    (tmp_path / "state" / "trainer_state-3").mkdir(parents=True)
    (tmp_path / "state" / "trainer_state-3" / "meta.pt").write_bytes(b"not a pickle")
    with pytest.raises(Exception, match=r"trainer state .*trainer_state-3 cannot be read .* move it away"):
        trainer_state.peek(tmp_path)

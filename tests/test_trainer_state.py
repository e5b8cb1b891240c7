"""The trainer state (opdkit.persist.trainer_state): a saved and restored run is the run it was, bit for
bit (weights, optimizer, EMA teacher, RNG), and continues identically; a failed write is retried
or leaves the previous state as it was; an older version's single file is still read.

The reference is the live run itself: its tensors are compared with ``torch.equal`` against a
fresh run that restored the state.
"""

from __future__ import annotations

import errno
import json

import pytest
import torch

from opdkit.config import load_config
from opdkit.persist import tensor_files, trainer_state
from opdkit.persist.fsutil import StorageError
from opdkit.scoring import unwrap
from opdkit.setup import RunError, build_run, prepare_inputs
from student_weights import trainable_state

BASE = ["runtime.threads=1", "budget.max_steps=4", "optim.lr=0.01", "optim.warmup_steps=0", "optim.schedule=constant",
        "publish.backoff_s=0"]
VARIANTS = {"full": [], "lora": ["lora.enabled=true", "lora.r=4"], "ema": ["teacher.source=privileged_ema"]}


def _run(*overrides: str):
    cfg = load_config(None, [*BASE, *overrides])
    run = build_run(cfg, prepare_inputs(cfg), log=lambda *_: None)
    run.lr_clock_start_s = 1.5
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
    index = json.loads((trainer_state.find(tmp_path) / "rank0.json").read_text())
    keys = {".".join(map(str, e["key"])) for e in index}
    assert "model.model.embed_tokens.weight" in keys and "model.lm_head.weight" not in keys
    resumed = _run()
    trainer_state.restore(resumed, trainer_state.peek(tmp_path))
    assert resumed.student.lm_head.weight is resumed.student.model.embed_tokens.weight
    _assert_same(live, resumed)


def test_a_transient_write_error_is_retried_and_a_new_state_replaces_the_old(tmp_path, monkeypatch):
    live = _run()
    _step(live)
    trainer_state.save(tmp_path, live, step=1, elapsed=0.0, data_pos=4, log=lambda *_: None)
    real, calls = tensor_files._pwrite_all, []

    def flaky(*a, **k):  # the NFS server went away for a moment, in the middle of the tensors
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(*a, **k)

    monkeypatch.setattr(tensor_files, "_pwrite_all", flaky)
    _step(live)
    logs: list[str] = []
    path = trainer_state.save(tmp_path, live, step=2, elapsed=1.0, data_pos=8, log=logs.append)
    assert any("transient I/O error while saving the trainer state at step 2" in ln for ln in logs)
    assert [p.name for p in (tmp_path / "state").iterdir()] == [path.name] == ["trainer_state-2"]
    resumed = _run()
    trainer_state.restore(resumed, trainer_state.peek(tmp_path))
    _assert_same(live, resumed)


def test_a_read_only_file_system_is_not_retried_and_the_previous_state_stays(tmp_path, monkeypatch):
    live = _run()
    _step(live)
    trainer_state.save(tmp_path, live, step=1, elapsed=0.0, data_pos=4, log=lambda *_: None)
    calls = []

    def erofs(*a, **k):
        calls.append(1)
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tensor_files, "_pwrite_all", erofs)
    _step(live)
    with pytest.raises(StorageError, match=r"state is on a read-only file system: the trainer state at step 2 needs"):
        trainer_state.save(tmp_path, live, step=2, elapsed=1.0, data_pos=8, log=lambda *_: None)
    assert len(calls) == 1  # not retried
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["trainer_state-1"]
    assert trainer_state.peek(tmp_path)["step"] == 1


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


def test_a_state_whose_tensor_file_is_cut_short_or_missing_is_refused_when_chosen(tmp_path):
    """meta.pt intact but rank0.bin truncated (or gone): peek accepted it and the restore found it, after the
    start had rewritten config.yaml and run.json; peek refuses it now, naming the file and what to do."""
    live = _run()
    _step(live)
    path = trainer_state.save(tmp_path, live, step=1, elapsed=1.0, data_pos=4, log=lambda *_: None)
    assert trainer_state.peek(tmp_path)["step"] == 1
    data = (path / "rank0.bin").read_bytes()
    (path / "rank0.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(RunError, match=rf"trainer state .*trainer_state-1: rank0.bin is {len(data) // 2} bytes but "
                                       rf"rank0.json places tensors up to byte {len(data)}: the file is truncated; "
                                       r"move .*trainer_state-1 away to resume from an older state"):
        trainer_state.peek(tmp_path)
    (path / "rank0.bin").unlink()
    with pytest.raises(RunError, match=r"No such file or directory: .*rank0.bin'; move .*trainer_state-1 away"):
        trainer_state.peek(tmp_path)


def test_the_newest_keep_states_are_kept_and_a_live_writers_leftover_is_left_alone(tmp_path):
    import os
    import subprocess
    import sys

    live = _run("publish.keep_states=2")
    state_dir = tmp_path / "state"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # another live process's save
    try:
        state_dir.mkdir()
        theirs = state_dir / f".tmp-trainer_state-9-{other.pid}-1"
        dead = state_dir / ".tmp-trainer_state-8-999999999-1"  # no such pid: a killed save's leftover
        ours = state_dir / f".tmp-trainer_state-7-{os.getpid()}-1"  # a failed attempt of this process
        for d in (theirs, dead, ours):
            d.mkdir()
        for step in (1, 2, 3):
            _step(live)
            trainer_state.save(tmp_path, live, step=step, elapsed=float(step), data_pos=4 * step, log=lambda *_: None)
        assert sorted(p.name for p in state_dir.iterdir()) == [theirs.name, "trainer_state-2", "trainer_state-3"]
    finally:
        other.kill()
        other.wait()
    resumed = _run("publish.keep_states=2")
    trainer_state.restore(resumed, trainer_state.peek(tmp_path))
    _assert_same(live, resumed)


def test_a_state_whose_shards_came_from_two_ranks_is_assembled_whole(tmp_path):
    """The pieces of each tensor as two ranks of a row-sharded run write them (rank r: rows r*n/2 .. (r+1)*n/2
    - 1, the plain tensors on rank 0 only) restore the unsharded run exactly."""
    from opdkit import distributed

    live = _run()
    _step(live)
    path = trainer_state.save(tmp_path, live, step=1, elapsed=0.0, data_pos=4, log=lambda *_: None)
    whole = json.loads((path / "rank0.json").read_text())
    pieces: list[list] = [[], []]
    for e in whole:
        t = tensor_files.view(path / "rank0.bin", e).clone()
        if t.dim() == 0 or t.shape[0] < 2:
            pieces[0].append((e["key"], t, list(t.shape), [0] * t.dim()))
            continue
        half = t.shape[0] // 2
        for r, rows in enumerate((t[:half], t[half:])):
            pieces[r].append((e["key"], rows, list(t.shape), [r * half] + [0] * (t.dim() - 1)))
    tensor_files.release([path / "rank0.bin"])
    for r in (0, 1):
        entries, _ = tensor_files.write_file(path / f"rank{r}.bin", iter(pieces[r]))
        (path / f"rank{r}.json").write_text(json.dumps(entries))
    meta = torch.load(path / "meta.pt", weights_only=False)
    torch.save({**meta, "ranks": 2}, path / "meta.pt")
    resumed = _run()
    trainer_state.restore(resumed, trainer_state.peek(tmp_path))
    _assert_same(live, resumed)
    (path / "rank1.bin").unlink()  # a rank's file lost: refused, saying what to do
    with pytest.raises(Exception, match=r"move .*trainer_state-1 away to resume from an older state"):
        trainer_state.restore(_run(), trainer_state.peek(tmp_path))
    assert distributed.current().size == 1


def test_a_state_of_the_previous_version_torch_distributed_checkpoint_is_still_read(tmp_path):
    import torch.distributed.checkpoint as dcp

    live = _run()
    _step(live)
    path = tmp_path / "state" / "trainer_state-1"
    with trainer_state._single_process_quiet():  # what the previous version wrote: DCP + meta.pt of format 2
        dcp.save(trainer_state._state_dicts(live), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    torch.save({"format": 2, "step": 1, "elapsed_s": 2.0, "data_pos": 4, "lr_clock_start_s": 1.5,
                "rng": torch.get_rng_state(), "rng_cuda": None, "config": {},
                "data_fingerprint": live.inputs.data_fingerprint}, path / "meta.pt")
    resumed = _run()
    trainer_state.restore(resumed, trainer_state.peek(tmp_path))
    _assert_same(live, resumed)
    trainer_state.save(tmp_path, resumed, step=2, elapsed=4.0, data_pos=8, log=lambda *_: None)
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["trainer_state-2"]

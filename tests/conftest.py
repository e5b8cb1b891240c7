"""Shared fixtures: tiny random models built from a config, and the shipped embedded ones."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

# Bytecode. Where PYTHONDONTWRITEBYTECODE is set (the sessions on this machine set it), no bytecode was cached: each
# worker rewrote the asserts of every test file again at collection (~3.5 s) and each Python process of the suite
# compiled the opdkit sources it imported again (~0.2 s a trainer). The suite's processes keep their bytecode under
# one folder of the temp directory instead (PYTHONPYCACHEPREFIX, which the workers and every child inherit), still
# writing none next to the sources. The first run there compiles what it imports once, site-packages included.
if sys.dont_write_bytecode and not os.environ.get("PYTHONPYCACHEPREFIX"):
    _prefix = os.path.join(tempfile.gettempdir(), f"opdkit-tests-pycache-{os.getuid()}")
    os.environ["PYTHONPYCACHEPREFIX"] = _prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.pycache_prefix, sys.dont_write_bytecode = _prefix, False

# torch, transformers and opdkit are imported where they are used (the workers' test files, the fixtures below), not
# here: xdist's controller process, which runs no test, loads this file too, and importing them there cost ~4 s
# before the workers started
if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per CPU (pyproject's -n auto): one thread each,
    import torch

    torch.set_num_threads(1)  # and idle OpenMP threads that sleep instead of spinning
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tok():
    from opdkit.embedded.tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(cfg).eval()


# The longest test files first. The suite runs whole files on xdist workers (--dist loadfile) in the
# collection order (--no-loadscope-reorder: xdist would otherwise start the files with the most tests
# first, so one long file of few tests, test_pipeline's dvc repro, started near the end and ran alone);
# with the longest first, the wall time is about the total over the workers, not a long file's tail.
# The order: per-file wall times measured with --durations (issue 27, a busy 2-core machine: shares
# only; test_end_of_run ~5 min, test_rank_faults and test_decode_kernels ~2 each, placed 2026-12-02 from
# their files' own runs); files not listed keep their order after these. It decides the order only, never what runs.
LONGEST_FIRST = ("test_pipeline.py", "test_end_of_run.py", "test_notebooks.py", "test_faults.py", "test_realscale.py",
                 "test_distributed.py", "test_resume.py", "test_cli_errors.py", "test_runsh.py", "test_rank_faults.py",
                 "test_decode_kernels.py", "test_teachers.py", "test_vllm_teacher.py",
                 "test_collectives.py", "test_fixture.py", "test_doctor.py",
                 "test_publish.py", "test_train_losses.py", "test_stage_jobs.py", "test_sampling.py",
                 "test_rollout.py", "test_privileged_live.py", "test_scoring.py", "test_studies.py")


@pytest.fixture(scope="session")
def runner():
    """``opdkit`` commands in processes forked from one that imported opdkit once (``signal_harness.OpdkitRunner``):
    for runs that need no signal of their own (a file's reruns, injected faults, run.sh's commands where its trainer
    is not signalled). One per test process (xdist worker): the files a worker runs share its imports."""
    from signal_harness import OpdkitRunner

    r = OpdkitRunner()
    yield r
    r.close()


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order

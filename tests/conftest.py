"""Shared fixtures: tiny random models built from a config, and the shipped embedded ones."""

from __future__ import annotations

import json
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
# longest first, each file goes to the worker that frees up first, and the short files at the end even out
# the two workers' ends (a long file last would leave the other worker idle for its tail).
# FILE_SECONDS: each file's seconds (its tests' setup + call + teardown) in the suite on the idle 2-core
# machine, the mean of two full runs (2026-12-04, 615 and 598 s of pytest wall); files not listed
# (under 2 s) run after these in their collection order. It decides the order only, never what runs.
# To measure again: OPDKIT_FILE_SECONDS=times.json pytest (the suite as usual) writes each file's seconds there.
FILE_SECONDS = {
    "test_end_of_run.py": 187, "test_pipeline.py": 119, "test_realscale.py": 84, "test_runsh.py": 82,
    "test_notebooks.py": 75, "test_rank_faults.py": 72, "test_vllm_teacher.py": 49, "test_collectives.py": 48,
    "test_decode_kernels.py": 48, "test_teachers.py": 45, "test_faults.py": 38, "test_resume.py": 37,
    "test_distributed.py": 32, "test_cli_errors.py": 22, "test_doctor.py": 20, "test_stage_jobs.py": 20,
    "test_xtok_run.py": 18, "test_sampling.py": 17, "test_policy.py": 17, "test_embedded_build.py": 17,
    "test_rewards.py": 16, "test_train_losses.py": 16, "test_schedules.py": 15, "test_overlap.py": 12,
    "test_fixture.py": 11, "test_offline.py": 10, "test_publish.py": 10, "test_trainer_state.py": 8, "test_xtok.py": 8,
    "test_thinking.py": 7, "test_config.py": 3, "test_deadline.py": 3, "test_rollout.py": 3, "test_overlap_bias.py": 3,
    "test_run_config.py": 2, "test_alignment.py": 2, "test_privileged_live.py": 2, "test_vllm_engine.py": 2,
    "test_studies.py": 2, "test_topk.py": 2,
}


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
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file's tests keep their order


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """With OPDKIT_FILE_SECONDS: each file's seconds, summed over its tests' phases (in the xdist controller, which
    gets every worker's reports, or the one process of -n 0)."""
    if os.environ.get("OPDKIT_FILE_SECONDS") and not os.environ.get("PYTEST_XDIST_WORKER"):
        name = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
        _file_seconds[name] = _file_seconds.get(name, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = os.environ.get("OPDKIT_FILE_SECONDS")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "w") as f:
            json.dump(dict(sorted(_file_seconds.items(), key=lambda kv: -kv[1])), f, indent=1)

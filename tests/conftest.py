"""Shared fixtures: tiny random models built from a config, and the shipped embedded ones."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from opdkit.embedded.tokenizer import build_tokenizer

if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per CPU (pyproject's -n auto): one thread each,
    torch.set_num_threads(1)  # and idle OpenMP threads that sleep instead of spinning
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tok):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(cfg).eval()

"""Shared fixtures: tiny random models built from a config, and the shipped embedded ones."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from opdkit.embedded.tokenizer import build_tokenizer


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

"""Bundles built once per test session (tiny random models; SmolLM2 only where a test asks for it)."""

from __future__ import annotations

import pytest
import torch


def _tiny_hf_dir(tmp_path_factory, kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = {"vocab_size": 300, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    model = LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    d = tmp_path_factory.mktemp(f"ckpt-{kind}")
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return _tiny_hf_dir(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    return _tiny_hf_dir(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_glm4_bundle(tiny_glm4_int8_bundle):
    return tiny_glm4_int8_bundle

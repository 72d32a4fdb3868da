"""bench.random_hf_models: every family's folder is written with transformers' own classes and loads
through our loader with the default tokenizer (tiny widths here; the real shapes only in speed runs)."""
from __future__ import annotations

import pytest
import torch

from bench import random_hf_models
from nightshift.engine.loader import load_model
from nightshift.engine.tokenizer import load_tokenizer

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128)


@pytest.mark.parametrize("name", sorted(random_hf_models.SHAPES))
def test_each_family_folder_loads(name, tmp_path, monkeypatch):
    config_class, model_class, fields = random_hf_models.SHAPES[name]
    tiny = {**fields, **TINY}
    if "num_experts" in fields:
        tiny.update(num_experts=4, num_experts_per_tok=2, num_key_value_heads=4)
    if "sliding_window" in fields:
        tiny.update(sliding_window=8, query_pre_attn_scalar=16)
    monkeypatch.setitem(random_hf_models.SHAPES, name, (config_class, model_class, tiny))
    folder = random_hf_models.write_random_folder(name, tmp_path / name)
    model = load_model(str(folder), dtype=torch.float32)
    assert model.config.vocab_size == random_hf_models.VOCAB and model.config.num_layers == 2
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert random_hf_models.write_random_folder(name, folder) == folder      # an existing folder is reused

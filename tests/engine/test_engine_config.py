"""EngineConfig: the engine's defaults in one place, options left out or None take them, and the
KV pool sizing rule."""
import math

import pytest
import torch

from bench.dummy_weights import build_dummy_model, dummy_config
from nightshift.engine.engine import Engine
from nightshift.engine.engine_config import (DEFAULT_KV_CACHE_BYTES, EngineConfig, default_kv_cache_bytes,
                                             resolve_device, resolve_dtype)
from nightshift.engine.kv_cache import kv_bytes_per_block
from nightshift.engine.tokenizer import load_tokenizer


def test_defaults_and_none_meaning_default():
    config = EngineConfig()
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (256, 1024, 16)
    assert config.enable_prefix_caching and config.num_kv_blocks is None and config.kv_cache_bytes is None
    assert EngineConfig.of(max_num_seqs=None, max_num_batched_tokens=None) == config
    assert EngineConfig.of(max_num_seqs=8, enable_prefix_caching=False) == \
        EngineConfig(max_num_seqs=8, enable_prefix_caching=False)
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.of(max_seqs=8)


def test_kv_pool_blocks_rule():
    model = dummy_config("llama-tiny")              # 2048 positions
    per_block = kv_bytes_per_block(model, 16, torch.float32)
    assert EngineConfig(num_kv_blocks=7).kv_pool_blocks(model, torch.float32, "cpu") == 7
    # as many blocks as the budget holds ...
    assert EngineConfig(kv_cache_bytes=10 * per_block + 1).kv_pool_blocks(model, torch.float32, "cpu") == 10
    # ... but never more than max_num_seqs full-context sequences use, and at least one
    most_useful = 2 * math.ceil(2048 / 16)
    huge = EngineConfig(max_num_seqs=2, kv_cache_bytes=1 << 40)
    assert huge.kv_pool_blocks(model, torch.float32, "cpu") == most_useful
    assert EngineConfig(kv_cache_bytes=1).kv_pool_blocks(model, torch.float32, "cpu") == 1
    assert default_kv_cache_bytes("cuda") == DEFAULT_KV_CACHE_BYTES
    assert DEFAULT_KV_CACHE_BYTES // 4 <= default_kv_cache_bytes("cpu") <= 4 << 30


def test_engine_takes_unset_options_from_the_config():
    model = build_dummy_model("llama-tiny", max_position_embeddings=64)
    tokenizer = load_tokenizer("default")
    engine = Engine.from_model(model, tokenizer, "tiny", max_num_seqs=None, kv_cache_bytes=None)
    assert engine.config == EngineConfig()
    assert engine.runner.num_kv_blocks == EngineConfig().kv_pool_blocks(model.config, model.dtype, "cpu")
    assert engine.scheduler.max_num_seqs == 256 and engine.scheduler.max_num_batched_tokens == 1024
    small = Engine.from_model(model, tokenizer, "tiny", config=EngineConfig(max_num_seqs=2, num_kv_blocks=9))
    assert small.runner.num_kv_blocks == 9 and small.scheduler.max_num_seqs == 2
    with pytest.raises(TypeError, match="either a config or engine options"):
        Engine.from_model(model, tokenizer, "tiny", max_num_seqs=2, config=EngineConfig())


def test_device_and_dtype_resolution():
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    assert resolve_dtype("bf16", "cpu") is torch.bfloat16 and resolve_dtype(torch.float16, "cpu") is torch.float16
    assert resolve_dtype(None, "cuda") is torch.bfloat16
    # the generation engine's float32 on every CPU (its CPU math chooses bf16 where that is faster)
    assert resolve_dtype(None, "cpu", cpu_default=torch.float32) is torch.float32
    assert resolve_dtype(None, "cuda", cpu_default=torch.float32) is torch.bfloat16
    assert resolve_dtype("bf16", "cpu", cpu_default=torch.float32) is torch.bfloat16

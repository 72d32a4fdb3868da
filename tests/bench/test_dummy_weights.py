"""Random-weight models of named Llama shapes (--dummy-weights)."""
import pytest
import torch

from bench.dummy_weights import DUMMY_SHAPES, DummyCheckpoint, build_dummy_model, dummy_config, dummy_engine
from nightshift.engine.types import GenerationRequest, SamplingParams


def test_shapes_are_the_real_llama_configs():
    c8 = dummy_config("llama-8b")
    assert (c8.hidden_size, c8.num_layers, c8.num_heads, c8.num_kv_heads, c8.intermediate_size, c8.vocab_size) == \
        (4096, 32, 32, 8, 14336, 128256)
    assert not c8.tie_word_embeddings
    c1 = dummy_config("llama-1b", max_position_embeddings=4096)
    assert (c1.hidden_size, c1.num_layers, c1.head_dim, c1.max_position_embeddings) == (2048, 16, 64, 4096)
    with pytest.raises(ValueError, match="unknown dummy model shape 'llama-70b'; known: llama-1b"):
        dummy_config("llama-70b")


def test_checkpoint_parameter_count_and_determinism():
    config = dummy_config("llama-1b")
    checkpoint = DummyCheckpoint(config, seed=1, device="meta")
    from bench.roofline import matmul_params_per_token
    shapes = checkpoint._shapes
    total = sum(torch.Size(s).numel() for s in shapes.values())
    # Llama 3.2 1B: 1.24B parameters (tied embeddings)
    assert abs(total - 1.236e9) / 1.236e9 < 0.01
    assert total > matmul_params_per_token(config)
    tiny = dummy_config("llama-tiny")
    a, b, other = DummyCheckpoint(tiny, seed=1), DummyCheckpoint(tiny, seed=1), DummyCheckpoint(tiny, seed=2)
    name = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(a.tensor(name), b.tensor(name))
    assert not torch.equal(a.tensor(name), other.tensor(name))
    assert not torch.equal(a.tensor(name), a.tensor("model.layers.0.mlp.up_proj.weight"))
    assert torch.equal(a.tensor("model.norm.weight"), torch.ones(tiny.hidden_size))
    assert a.tensor("lm_head.weight") is None and a.gguf(name) is None


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_dummy_engine_generates_the_requested_tokens(quantization):
    engine = dummy_engine("llama-tiny", quantization=quantization, device="cpu", max_num_seqs=4)
    assert engine.model_name == "dummy-llama-tiny"
    prompt = engine.tokenizer.encode("Hello there, how are you?")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outputs = list(engine.generate([GenerationRequest(f"r{i}", prompt, params) for i in range(3)]))
    assert [o.completion_tokens for o in outputs] == [5, 5, 5]
    assert all(o.finish_reason == "length" for o in outputs)
    # same weights, same prompt, greedy: the same tokens
    assert len({tuple(o.token_ids) for o in outputs}) == 1


def test_every_named_shape_builds_on_meta():
    for name in DUMMY_SHAPES:
        model = build_dummy_model(name, device="meta", max_position_embeddings=64)
        assert model.config.name == f"dummy-{name}"


def test_dummy_engine_takes_a_saved_tokenizer_directory(tmp_path):
    """A tokenizer shipped without its model (how the GPU benchmarks carry it) loads by directory."""
    from nightshift.engine.tokenizer import load_tokenizer
    default = load_tokenizer("default")
    default.save(tmp_path)
    engine = dummy_engine("llama-tiny", device="cpu", max_num_seqs=2, tokenizer=str(tmp_path))
    text = "Hello there, how are you?"
    assert engine.tokenizer.encode(text) == default.encode(text)
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]) == \
        default.apply_chat_template([{"role": "user", "content": text}])

"""bench/cpu_time.py: the run's time per kind of CPU kernel, and the floor its K/V reads set."""
from __future__ import annotations

import pytest
import torch

from bench import cpu_time
from nightshift.engine.kernels import cpu_fused_ops
from nightshift.engine.layers import cpu_gemm
from nightshift.engine.model_config import ModelConfig


def config(**overrides) -> ModelConfig:
    shape = dict(architecture="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=100, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=512, tie_word_embeddings=True)
    return ModelConfig(**(shape | overrides))


def test_own_kv_positions_count_each_decode_step_past_the_shared_prefix():
    # prompts of 40 and 50 positions, 32 shared, 4 output tokens: the steps of tokens 1, 2, 3 attend
    # 41/51, 42/52, 43/53 positions, of which 9/19, 10/20, 11/21 are the row's own; two layers
    steps = cpu_time.own_kv_positions(config(), [40, 50], 4, 32)
    assert steps.tolist() == [2 * (9 + 19), 2 * (10 + 20), 2 * (11 + 21)]
    # one layer of two sliding over the last 16 positions: the 50-position row's window lies past
    # the prefix (16 own positions a step), the 40-position row's reaches into it (as without a window)
    sliding = config(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    assert cpu_time.own_kv_positions(sliding, [40, 50], 4, 32).tolist() == [9 + 16 + 9 + 19, 10 + 16 + 10 + 20,
                                                                             11 + 16 + 11 + 21]
    # a window reaching into the prefix: only the part after it is the row's own
    wide = config(sliding_window=30, layer_types=["sliding_attention"] * 2)
    assert cpu_time.own_kv_positions(wide, [40], 2, 32).tolist() == [2 * (41 - 32)]


def test_the_shared_prefix_is_whole_blocks_of_what_every_prompt_starts_with():
    prompts = [list(range(40)), list(range(37)) + [99, 98], list(range(45))]
    assert cpu_time.shared_prefix_positions(prompts, 16) == 32
    assert cpu_time.shared_prefix_positions(prompts, 8) == 32
    assert cpu_time.shared_prefix_positions(prompts[:1] + [[5] + list(range(1, 40))], 16) == 0


def test_kv_read_bound_is_bytes_over_the_measured_read_rate(monkeypatch):
    monkeypatch.setattr(cpu_time, "memory_read_rate", lambda: 2e9)
    prompts = [list(range(40)), list(range(32)) + [7] * 18]
    bound = cpu_time.kv_read_bound(config(), torch.bfloat16, prompts, 4, 16)
    per_position = 2 * 2 * 16 * 2               # K and V, 2 KV heads of 16, bfloat16
    assert bound.shared == 32 and bound.bytes == (2 * (9 + 19 + 10 + 20 + 11 + 21)) * per_position
    assert bound.step_bytes == 2 * (11 + 21) * per_position and bound.seconds == bound.bytes / 2e9


def test_memory_read_rate_is_a_plausible_bandwidth():
    rate = cpu_time.memory_read_rate(64 * 2**20, repeats=2)
    assert 1e8 < rate < 1e13


def test_the_clock_times_each_kind_of_kernel_and_puts_the_entry_points_back():
    original = cpu_gemm.linear, cpu_fused_ops.silu_mul
    clock = cpu_time.KernelClock()
    with clock.running():
        assert cpu_gemm.linear is not original[0]
        for _ in range(3):
            cpu_gemm.linear(torch.randn(4, 8), torch.randn(5, 8))
        if cpu_fused_ops.load() is not None:
            cpu_fused_ops.silu_mul(torch.randn(2, 16).bfloat16())
    assert (cpu_gemm.linear, cpu_fused_ops.silu_mul) == original
    assert clock.calls["linear layers and LM head"] == 3 and clock.seconds["linear layers and LM head"] > 0
    lines = clock.lines(10.0)
    # the kinds largest first (which kind is largest depends on these tiny calls' timings), then the rest
    kinds = sorted(clock.seconds, key=lambda kind: -clock.seconds[kind])
    assert [line[:32].strip() for line in lines[:-1]] == kinds and "linear layers and LM head" in kinds
    assert lines[-1].startswith("the rest")
    rest = 10.0 - sum(clock.seconds.values())
    assert f"{rest:7.2f} s" in lines[-1]


def test_the_clock_counts_a_call_that_raises():
    clock = cpu_time.KernelClock()
    with clock.running(), pytest.raises(RuntimeError):
        cpu_gemm.linear(torch.randn(4, 8), torch.randn(5, 7))       # shapes that do not multiply
    assert clock.calls["linear layers and LM head"] == 1


def test_the_clock_times_an_lm_head_on_q8_0_blocks_as_its_own_kind():
    """The Q8_0 head's methods are a class's attributes: called through an instance, they are timed
    too (here a head without weights, whose call fails and still counts), and put back after."""
    from nightshift.engine.layers.q8_head import Q8Head
    original = Q8Head.linear, Q8Head.linear_int8
    head = object.__new__(Q8Head)
    clock = cpu_time.KernelClock()
    with clock.running():
        with pytest.raises(AttributeError):
            head.linear(torch.randn(2, 32))
        with pytest.raises(AttributeError):
            head.linear_int8(torch.randn(2, 32))
    assert (Q8Head.linear, Q8Head.linear_int8) == original
    assert clock.calls == {"LM head on Q8_0 blocks": 2}


def test_the_clock_times_an_int4_models_layers_on_our_kernels_as_their_own_kind():
    from nightshift.engine.quant import cpu_w4_bf16, cpu_w4a8
    from nightshift.engine.quant.format import quantize_rtn

    weight = quantize_rtn(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), 32, clip_search=False)
    clock = cpu_time.KernelClock()
    x = torch.randn(4, 64).bfloat16()
    with clock.running():
        if cpu_w4a8.available():
            cpu_w4a8.W4A8Weight(weight).linear(x)
        if cpu_w4_bf16.available():
            cpu_w4_bf16.W4Bf16Weight(weight).linear(x)
    expected = {}
    if cpu_w4a8.available():
        expected["INT4 linear layers (W4A8)"] = 1
    if cpu_w4_bf16.available():
        expected["INT4 linear layers (4-bit x bf16)"] = 1
    assert clock.calls == expected and expected      # this CI machine has AVX2 at least
    assert "timed" not in cpu_w4a8.W4A8Weight.linear.__qualname__

"""The one choice of attention backend (engine/attention/__init__.py): by option, device, dtype and
whether the C kernel builds. (The Triton choice is checked in tests/engine/kernels/, which import
Triton under its interpreter.)"""
import pytest
import torch

from bench.dummy_weights import dummy_config
from nightshift.engine.attention import (AttentionOptions, CpuKernelAttention, TorchAttention,
                                         select_attention_backend)
from nightshift.engine.kernels import cpu_paged_attention

CONFIG = dummy_config("llama-tiny")       # 4 heads, 2 KV heads, head dim 16
CPU = torch.device("cpu")


def select(dtype=torch.float32, device=CPU, **options):
    return select_attention_backend(CONFIG, 16, dtype, device, AttentionOptions(**options))


@pytest.fixture
def kernel_builds(monkeypatch):
    """Pretend the C kernel builds (whether or not this machine has a compiler)."""
    monkeypatch.setattr(cpu_paged_attention, "load", lambda group, head_dim: object())


def test_cpu_float32_takes_the_c_kernel_for_decode_rows(kernel_builds):
    assert isinstance(select(), CpuKernelAttention)
    assert isinstance(select(attention_backend="torch"), CpuKernelAttention)


def test_torch_path_when_the_kernel_is_off_or_cannot_run(kernel_builds):
    for backend in (select(cpu_kernel=False), select(dtype=torch.bfloat16), select(device=torch.device("meta"))):
        assert type(backend) is TorchAttention
    torch_path = select(cpu_kernel=False, decode_bucket=8, shared_prefix_attention=False)
    assert (torch_path.decode_bucket, torch_path.shared_prefix_attention) == (8, False)


def test_torch_path_when_the_kernel_does_not_build(monkeypatch):
    monkeypatch.setattr(cpu_paged_attention, "load", lambda group, head_dim: None)   # no compiler, failed build
    assert type(select()) is TorchAttention


def test_environment_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setattr(cpu_paged_attention, "_libs", {})      # nothing loaded yet in this process
    monkeypatch.setenv("NIGHTSHIFT_CPU_ATTENTION", "0")
    assert type(select()) is TorchAttention


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend must be 'auto', 'torch' or 'triton', got 'flash'"):
        AttentionOptions(attention_backend="flash")

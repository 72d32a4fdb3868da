"""Int4Linear on CPU (tinygemm for small steps, dense dequantized above) vs the torch reference."""
import pytest
import torch
import torch.nn.functional as F

from nightshift.engine.layers import cpu_gemm, cpu_math
from nightshift.engine.layers.linear import GGUFBlocks, WeightSource
from nightshift.engine.layers.linear import DenseLinear
from nightshift.engine.quant.cache import QuantizedCheckpointCache, cache_file
from nightshift.engine.quant.config import QuantConfig, resolve_quant_config
from nightshift.engine.quant import cpu_w4_bf16, cpu_w4a8
from nightshift.engine.quant.cpu_kernels import pack_for_tinygemm, tinygemm_linear, tinygemm_scales_and_zeros
from nightshift.engine.quant.format import quantize_rtn
from nightshift.engine.quant.int4_linear import Int4Linear
from nightshift.engine.quant.linear_factory import Int4LinearFactory


@pytest.fixture
def weight():
    torch.manual_seed(0)
    return quantize_rtn(torch.randn(192, 384) * 0.05, 64)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
def test_tinygemm_matches_dequantized_reference(weight, dtype, tol):
    x = torch.randn(3, 384)
    ref = x @ weight.dequantize().t()
    out = tinygemm_linear(x.to(dtype), pack_for_tinygemm(weight), 64, tinygemm_scales_and_zeros(weight, dtype))
    assert out.dtype == dtype
    assert ((out.float() - ref).abs().max() / ref.abs().max()) < tol


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 40])
def test_int4_linear_both_paths(weight, rows):
    bias = torch.randn(192)
    layer = Int4Linear(weight, bias, cpu_int4_max_rows=8)
    x = torch.randn(rows, 384)
    small = "w4-bf16" if cpu_w4_bf16.available() else "tinygemm"        # ours where the CPU has AVX-512 BF16
    assert layer.kernel_for(x) == (small if rows <= 8 else "dense")
    ref = F.linear(x, weight.dequantize(), bias)
    out = layer(x)
    assert out.shape == (rows, 192) and out.dtype == torch.float32
    # the small-step kernels run with bfloat16 activations (relative ~4e-3); the dense path is float32
    tol = 1e-2 if rows <= 8 else 1e-5
    assert ((out - ref).abs().max() / ref.abs().max()) < tol


@pytest.mark.skipif(not cpu_w4a8.available(), reason="needs an x86 CPU with AVX2 and a C compiler")
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_int4_linear_on_the_w4a8_kernel(weight, rows):
    bias = torch.randn(192)
    layer = Int4Linear(weight, bias, cpu_kernel="w4a8")
    x = torch.randn(2, rows, 384)
    assert layer.kernel_for(x[0]) == "w4a8"
    out = layer(x)
    packed = cpu_w4a8.W4A8Weight(weight)
    assert out.shape == (2, rows, 192) and out.dtype == torch.float32
    assert torch.equal(out, packed.linear(x.reshape(-1, 384), bias).reshape(2, rows, 192))
    ref = F.linear(x, weight.dequantize(), bias)
    assert ((out - ref).abs().max() / ref.abs().max()) < 2e-2          # int8 activations
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert not layer._dense                                            # no dense copy kept
    with pytest.raises(ValueError, match="cpu_kernel must be one of"):
        Int4Linear(weight, bias, cpu_kernel="int2")


def test_int4_linear_on_w4a8_serves_the_fused_layers_bf16_calls(weight):
    layer = Int4Linear(weight, None, cpu_math="bf16", cpu_kernel="w4a8", cache_dense_weight=False)
    assert layer.bf16_ready()
    if not cpu_w4a8.available():
        return
    x = torch.randn(12, 384).bfloat16()
    assert torch.equal(layer.linear_bf16(x), cpu_w4a8.W4A8Weight(weight).linear(x))
    assert not Int4Linear(weight, None, cpu_math="bf16", cache_dense_weight=False).bf16_ready()


def test_int4_linear_keeps_leading_dims_and_dense_cache(weight):
    x = torch.randn(2, 10, 384)
    cached = Int4Linear(weight, cpu_int4_max_rows=0, cache_dense_weight=True)
    uncached = Int4Linear(weight, cpu_int4_max_rows=0, cache_dense_weight=False)
    # the kept float32 weight is held for the CPU math (float32: oneDNN's packed GEMM,
    # engine/layers/cpu_gemm.py), the per-call one runs F.linear: the same products, summed in
    # another order
    torch.testing.assert_close(cached(x), uncached(x), rtol=1e-5, atol=1e-5)
    assert cached(x).shape == (2, 10, 192)
    assert len(cached._dense) == 1 and not uncached._dense
    kept = next(iter(cached._dense.values()))
    assert isinstance(kept, cpu_math.MathWeight) == cpu_gemm.available()
    if "bf16" in cpu_math.supported():   # another CPU math: the kept weight is held for it
        bf16 = Int4Linear(weight, cpu_int4_max_rows=0, cpu_math="bf16")
        torch.testing.assert_close(bf16(x), uncached(x), rtol=0.02, atol=0.02 * uncached(x).abs().max().item())
        assert next(iter(bf16._dense.values())).math == "bf16"
    assert "qweight" in cached.state_dict() and cached.state_dict()["qweight"].dtype == torch.uint8


def _source(tensors, gguf=None, name="model.layers.0.mlp.gate_up_proj", parts=("a", "b")):
    return WeightSource(name=name, parts=list(parts), tensor=lambda n: tensors.get(n),
                        gguf=lambda n: (gguf or {}).get(n), dtype=torch.float32, device=torch.device("cpu"))


def test_int4_factory_rtn_from_dense_and_gguf_import():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    torch.manual_seed(0)
    a, b = torch.randn(64, 128), torch.randn(32, 128)
    layer = Int4LinearFactory(QuantConfig(group_size=128))(_source({"a.weight": a, "b.weight": b}))
    assert layer.group_size == 128 and layer.out_features == 96
    assert torch.equal(layer.int4_weight.dequantize(), quantize_rtn(torch.cat([a, b]), 128).dequantize())

    raws = {n: quantize(t.numpy(), GGMLQuantizationType.Q4_1) for n, t in (("a", a), ("b", b))}
    blocks = {f"{n}.weight": GGUFBlocks(r, int(GGMLQuantizationType.Q4_1), t.shape[0], 128)
              for (n, r), t in zip(raws.items(), (a, b))}
    layer = Int4LinearFactory(QuantConfig())(_source({"a.weight": a, "b.weight": b}, blocks))
    expected = torch.cat([torch.from_numpy(dequantize(r, GGMLQuantizationType.Q4_1)) for r in raws.values()])
    assert layer.group_size == 32 and torch.equal(layer.int4_weight.dequantize(), expected)
    # asked not to import the blocks: re-quantized with RTN at the configured group
    layer = Int4LinearFactory(QuantConfig(group_size=64, import_gguf_blocks=False))(
        _source({"a.weight": a, "b.weight": b}, blocks))
    assert layer.group_size == 64


def test_int4_factory_keeps_full_precision_layers_dense():
    factory = Int4LinearFactory(QuantConfig())
    head = factory(_source({"lm_head.weight": torch.randn(8, 32)}, name="lm_head", parts=("lm_head",)))
    assert isinstance(head, DenseLinear) and factory.is_dense("lm_head")
    assert not factory.is_dense("model.layers.0.mlp.down_proj")


def test_quantized_checkpoint_cache_round_trip(tmp_path):
    torch.manual_seed(0)
    src = _source({"a.weight": torch.randn(64, 128), "b.weight": torch.randn(32, 128)})
    config = QuantConfig(group_size=32)
    cache = QuantizedCheckpointCache(cache_file(tmp_path, "f" * 64, config))
    first = Int4LinearFactory(config, cache)(src)
    assert cache.misses == 1 and cache.hits == 0
    cache.save_if_changed()
    files = list((tmp_path / "int4").glob("*.safetensors"))
    assert len(files) == 1
    empty = _source({})  # a cache hit never touches the checkpoint
    cache = QuantizedCheckpointCache(cache_file(tmp_path, "f" * 64, config))
    second = Int4LinearFactory(config, cache)(empty)
    assert cache.hits == 1 and cache.misses == 0
    assert torch.equal(first.qweight, second.qweight) and torch.equal(first.scales, second.scales)
    other = QuantizedCheckpointCache(cache_file(tmp_path, "f" * 64, QuantConfig(group_size=64)))
    assert other.get(src.name) is None  # another config is another file


def test_quant_config_layers_and_resolution():
    config = QuantConfig()
    assert config.quantizes("model.layers.0.self_attn.o_proj")
    assert not config.quantizes("lm_head") and not config.quantizes("model.embed_tokens")
    assert config.quantizes("blk.0.attn_output") and not config.quantizes("output")
    assert resolve_quant_config("none") is None and resolve_quant_config("int4") == QuantConfig()
    with pytest.raises(ValueError, match="'none' or 'int4'"):
        resolve_quant_config("int8")
    with pytest.raises(ValueError, match="group_size"):
        QuantConfig(group_size=16)


def test_small_steps_take_torchs_int4_kernel_where_ours_does_not_run(weight, monkeypatch):
    monkeypatch.setattr(cpu_w4_bf16, "available", lambda: False)        # a CPU without AVX-512 BF16
    layer = Int4Linear(weight, None, cpu_int4_max_rows=8)
    x = torch.randn(3, 384)
    assert layer.kernel_for(x) == "tinygemm"
    expected = tinygemm_linear(x.bfloat16(), pack_for_tinygemm(weight), 64,
                               tinygemm_scales_and_zeros(weight, torch.bfloat16)).float()
    assert torch.equal(layer(x), expected)
    assert layer._w4_bf16 is None                                       # ours never packed

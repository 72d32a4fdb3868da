"""GGUF Q4_0/Q4_1 blocks import into our format without any loss (bitwise vs gguf's dequantizer)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from nightshift.engine.quant.gguf_import import int4_from_gguf_blocks, int4_from_gguf_tensor


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_import_equals_gguf_dequantize_exactly(qtype):
    rng = np.random.default_rng(0)
    dense = (rng.standard_normal((48, 256)) * rng.uniform(0.001, 2.0, (48, 1))).astype(np.float32)
    dense[5] += 3.0  # offset rows: exercises Q4_1's min, and Q4_0's asymmetric range
    raw = quantize(dense, qtype)
    reference = torch.from_numpy(dequantize(raw, qtype))
    weight = int4_from_gguf_blocks(raw, qtype, 48, 256)
    assert weight.group_size == 32
    assert torch.equal(weight.dequantize(torch.float32), reference)


def test_real_default_model_tensors_import_exactly(default_model_path):
    reader = GGUFReader(default_model_path)
    q4 = [t for t in reader.tensors if t.tensor_type == GGMLQuantizationType.Q4_1]
    assert q4, "the default model ships Q4_1 tensors"
    for tensor in q4[:9]:
        weight = int4_from_gguf_tensor(tensor)
        reference = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
        assert torch.equal(weight.dequantize(), reference), tensor.name


def test_import_rejects_other_types_and_bad_sizes():
    raw = np.zeros((4, 34), dtype=np.uint8)
    with pytest.raises(ValueError, match="Q8_0 cannot be imported directly"):
        int4_from_gguf_blocks(raw, GGMLQuantizationType.Q8_0, 4, 32, name="w")
    with pytest.raises(ValueError, match="w: 72 bytes of Q4_0 data, expected 36"):
        int4_from_gguf_blocks(np.zeros(72, np.uint8), GGMLQuantizationType.Q4_0, 2, 32, name="w")

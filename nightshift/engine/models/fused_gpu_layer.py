"""A Llama-shaped decoder layer on the GPU with its small ops as three Triton kernels.

The torch layer (llama.DecoderLayer) runs ~17 small kernels per layer besides its four linears and
attention (RMSNorm: a cast to float32, the norm, a cast back, the scale; RoPE: a negation, a
concatenation, two products and a sum; SiLU and the product with up; two residual adds). At batch
1 on an H200 they took ~1 ms of an 8B INT4 step's ~3.7 ms of GPU time (`python -m
bench.roofline_bench --profile 1`); with this form the step went 4.00 -> 3.20 ms (250 -> 312 tok/s),
batch 256 19.31 -> 17.36 ms, the 2k prefill 68 -> 58 ms. This form of the same layer runs them as the kernels of
engine/kernels/gpu_fused_ops.py, which round where the torch ops round, so it computes the torch
layer's results to within a unit in the last place of a few entries (their docstring says where);
per layer:

    h = add_rms_norm(x)                          the residual stream x is updated in place
    qkv = qkv_proj(h); rope_(q and k heads of qkv)   rotated in place in the qkv output
    store k, v; a = attention(q)                 the Triton backend's kernels
    h = add_rms_norm(x += o_proj(a))
    x += down_proj(silu_mul(gate_up_proj(h)))

The linears are the layer's own modules (dense or INT4, engine/quant), so the weights are shared,
not copied. It runs where it fits (``build``): a model on CUDA, the plain Llama layer (llama.
plain_layer: RMSNorm, SiLU, no sliding window or soft-capping; a q/k/v bias is fine) without q/k norms,
and, per step, the Triton attention backend. ``NIGHTSHIFT_GPU_FUSED_OPS=0`` turns it off.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

ENV = "NIGHTSHIFT_GPU_FUSED_OPS"
BACKEND = "triton"          # the attention backend these layers run with


class FusedGpuLayer:
    """One decoder layer run through the fused kernels (``__call__`` is the layer's forward: the
    residual stream `x` is updated in place and returned)."""

    def __init__(self, layer, ops):
        self.ops = ops                                      # engine/kernels/gpu_fused_ops
        self.attn, self.mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        attn = self.attn
        self.qk_size = attn.q_size + attn.kv_size
        self.heads = attn.num_heads + attn.num_kv_heads

    def __call__(self, x, cos, sin, kv_cache, attention, meta) -> torch.Tensor:
        ops, attn, tokens = self.ops, self.attn, x.shape[0]
        norm, post = self.input_norm, self.post_norm
        qkv = attn.qkv_proj(ops.add_rms_norm(x, None, norm.weight, norm.eps))
        qk = ops.rope_(qkv[:, :self.qk_size].view(tokens, self.heads, attn.head_dim), cos, sin)
        q, k = qk.split([attn.num_heads, attn.num_kv_heads], dim=1)
        v = qkv[:, self.qk_size:].view(tokens, attn.num_kv_heads, attn.head_dim)
        k_cache, v_cache = kv_cache
        attention.store_kv(k_cache, v_cache, k, v, meta)
        out = attention.forward(q, k, v, k_cache, v_cache, meta, attn.scale)
        h = ops.add_rms_norm(x, attn.o_proj(out.reshape(tokens, attn.q_size)), post.weight, post.eps)
        return x.add_(self.mlp.down_proj(ops.silu_mul(self.mlp.gate_up_proj(h))))


def build(model, plain: Callable[[object], bool]) -> Optional[list[FusedGpuLayer]]:
    """Every layer of `model` in fused form, or None where one does not fit (not on CUDA, Triton
    missing, NIGHTSHIFT_GPU_FUSED_OPS=0): the model then runs its torch layers. `plain` says whether
    a layer is the plain Llama layer (the model's own judgement: llama.plain_layer)."""
    if os.environ.get(ENV, "1") == "0" or model.embed_tokens.device.type != "cuda":
        return None
    if not model.layers or not all(plain(layer) and layer.self_attn.q_norm is None for layer in model.layers):
        return None                         # (q/k norms, Qwen3's: not in these kernels)
    try:
        from nightshift.engine.kernels import gpu_fused_ops
    except ImportError:                     # no Triton here
        return None
    return [FusedGpuLayer(layer, gpu_fused_ops) for layer in model.layers]

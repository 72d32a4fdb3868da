"""Decoder layers whose projections compute bfloat16 in and out (the CPU's bf16 math, or INT4 on
the W4A8 kernel) as a few fused C kernels: the Llama-shaped layer (FusedCpuLayer) and Gemma
2/3's (FusedGemmaCpuLayer).

The torch layer (llama.DecoderLayer) with the bf16 CPU math casts every linear's input to
bfloat16 and its result back to float32, and runs its norms, RoPE, K/V store and SiLU-and-mul as
several tensor ops each. This form of the same layer keeps the linears' results bfloat16 and hands
them straight to the kernels of engine/kernels/cpu_fused_ops.py, which compute in float32 and round
to bfloat16 only where the torch path does (a linear's input and output), so both give the same
answers up to float32 summation order; per layer:

    h = add_rms_norm(x)                         the residual stream x stays float32
    q = rope_store(qkv_proj(h))                 (q/k norms,) RoPE; k, v written into the K/V pool
    a = attention(q)                            the C paged kernel, K/V read from the pool
    h = add_rms_norm(x += o_proj(a))
    x += down_proj(silu_mul(gate_up_proj(h)))

The runner's K/V pool holds bfloat16 under these layers (``LlamaForCausalLM.kv_dtype``): K and
V are rounded once as they are stored, as a bfloat16 model's are, and attention, which on CPU is
bound by reading the pool, reads half the bytes.

It runs where every piece fits (``build``): a float32 model on CPU whose projections compute
bfloat16 in and out (dense bf16 weights: engine/layers/cpu_math.py chose or was told bf16; INT4
layers on that math; or INT4 layers on the W4A8 kernel on any math, quant/cpu_w4a8.py), every
layer of a form the model class names (``fused_cpu_form``: the plain Llama layer, with Qwen3's
per-head q/k RMSNorms or Qwen2's q/k/v bias; Gemma's layer; the mixture-of-experts layer of
models/fused_moe_cpu_layer.py), the C kernels built, and, per step,
the CPU kernel attention backend (whose K/V store this replaces).
Anything else keeps the torch layer. ``NIGHTSHIFT_CPU_FUSED_OPS=0`` turns it off. A small step of
an INT4 model whose layers are all the plain form or all Gemma's runs them in one C call instead
(models/fused_cpu_stack.py: the same kernels, the same bits, without the Python between them).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from nightshift.engine.kernels import cpu_fused_ops
from nightshift.engine.layers.cpu_math import Bf16Weight
from nightshift.engine.layers.linear import DenseLinear
from nightshift.engine.quant.int4_linear import Int4Linear

ENV = "NIGHTSHIFT_CPU_FUSED_OPS"
BACKEND = "cpu-kernel"      # the attention backend whose K/V store rope_store does (slot_mapping rows)


def bf16_weight(module, bias_allowed: bool):
    """What computes the projection bfloat16 in and out (``linear_bf16``): a dense layer's
    Bf16Weight, or an INT4 layer that can (quant/int4_linear.py ``bf16_ready``: on the W4A8
    kernel, or on the bf16 math with tinygemm for small steps and its dequantized Bf16Weight for
    large ones); None where neither applies."""
    if module.bias is not None and not bias_allowed:
        return None
    if type(module) is DenseLinear and isinstance(module.packed, Bf16Weight):
        return module.packed
    if type(module) is Int4Linear and module.bf16_ready():
        return module
    return None


def _weight(norm) -> torch.Tensor:
    """An RMSNorm's scale as the kernels take it: float32, contiguous."""
    return norm.weight.detach().float().contiguous()


def _gemma_weight(norm) -> torch.Tensor:
    """A GemmaRMSNorm's scale ``1 + w``, computed in float32 as GemmaRMSNorm does."""
    return (1.0 + norm.weight.detach().float()).contiguous()


class _FusedLayer:
    """What every form shares: the four projections (``linear_bf16``), and the attention block from
    the normed input to o_proj's bfloat16 result (q/k norms, per head or over the whole projection,
    OLMoE's clip, RoPE and the K/V store in ``rope_store``; the layer's window and soft-capping in
    the attention kernel). ``from_layer`` builds the form of a torch layer, or None where one of
    its projections cannot compute bfloat16 in and out."""

    qkv_bias_allowed = True             # a q/k/v bias (Qwen2's) goes into rope_store

    def __init__(self, layer, qkv, o, gate_up, down, norm_weight):
        attn = layer.self_attn
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        bias = attn.qkv_proj.bias
        self.qkv_bias = None if bias is None else bias.detach().float().contiguous()
        self.qk_norm = None if attn.q_norm is None else (norm_weight(attn.q_norm), norm_weight(attn.k_norm),
                                                         attn.q_norm.eps)
        self.clip = getattr(attn, "clip", None)           # OLMoE's clip_qkv
        self.num_heads, self.q_size, self.scale = attn.num_heads, attn.q_size, attn.scale
        self.window, self.softcap = attn.window, attn.softcap

    @classmethod
    def from_layer(cls, layer, weight: Callable = bf16_weight):
        """`weight(module, bias_allowed)`: what computes a projection (``bf16_weight``; the small-step
        stack passes its own, models/fused_cpu_stack.py), None where nothing can."""
        attn, mlp = layer.self_attn, layer.mlp
        weights = (weight(attn.qkv_proj, cls.qkv_bias_allowed), weight(attn.o_proj, False),
                   weight(mlp.gate_up_proj, False), weight(mlp.down_proj, False))
        return None if any(w is None for w in weights) else cls(layer, *weights)

    def attend(self, h, cos, sin, kv_cache, attention, meta) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        q = cpu_fused_ops.rope_store(self.qkv.linear_bf16(h), self.qkv_bias, cos, sin, meta.slot_mapping,
                                     k_cache, v_cache, self.num_heads, self.qk_norm, clip=self.clip)
        out = attention.forward(q, None, None, k_cache, v_cache, meta, self.scale,   # K/V read from the pool
                                window=self.window, softcap=self.softcap)
        return self.o.linear_bf16(out.reshape(-1, self.q_size).to(torch.bfloat16))


class FusedCpuLayer(_FusedLayer):
    """One Llama-shaped decoder layer run through the fused kernels (``__call__`` is the layer's
    forward: the residual stream `x` is updated in place and returned)."""

    def __init__(self, layer, qkv, o, gate_up, down):
        super().__init__(layer, qkv, o, gate_up, down, _weight)
        self.input_norm, self.post_norm = _weight(layer.input_layernorm), _weight(layer.post_attention_layernorm)
        self.eps, self.post_eps = layer.input_layernorm.eps, layer.post_attention_layernorm.eps

    def __call__(self, x, cos, sin, kv_cache, attention, meta) -> torch.Tensor:
        h = cpu_fused_ops.add_rms_norm(x, None, self.input_norm, self.eps)
        h = cpu_fused_ops.add_rms_norm(x, self.attend(h, cos, sin, kv_cache, attention, meta), self.post_norm,
                                       self.post_eps)
        # the residual add in the C kernel: float32 += bfloat16, the bits of x.add_, without torch's
        # promotion of the bfloat16 operand (~12 against ~5 us a 256-row step, ad hoc, Zen 5)
        cpu_fused_ops.add_rms_norm(x, self.down.linear_bf16(cpu_fused_ops.silu_mul(self.gate_up.linear_bf16(h))),
                                   None, self.eps)
        return x


class FusedGemmaCpuLayer(_FusedLayer):
    """A Gemma 2 / Gemma 3 decoder layer (models/gemma.py) through the same kernels: its norms
    scale by ``1 + w`` (given to the kernels as that float32 weight, as GemmaRMSNorm computes it),
    the sandwich norms normalise each sublayer's result before the residual add
    (``add_rms_norm``'s delta weight), GeGLU (``gelu_tanh_mul``), Gemma 3's q/k norms in
    ``rope_store``, and the layer's sliding window and soft-capping handed to the attention kernel;
    per layer:

        h = pre_attn_norm(x)
        q = rope_store(qkv_proj(h)); a = attention(q, window, softcap)
        x += post_attn_norm(o_proj(a)); h = pre_ff_norm(x)
        x += post_ff_norm(down_proj(gelu_tanh_mul(gate_up_proj(h))))
    """

    qkv_bias_allowed = False

    def __init__(self, layer, qkv, o, gate_up, down):
        super().__init__(layer, qkv, o, gate_up, down, _gemma_weight)
        self.input_norm = _gemma_weight(layer.input_layernorm)
        self.post_attn_norm = _gemma_weight(layer.post_attention_layernorm)
        self.pre_ff_norm = _gemma_weight(layer.pre_feedforward_layernorm)
        self.post_ff_norm = _gemma_weight(layer.post_feedforward_layernorm)
        self.eps = layer.input_layernorm.eps

    def __call__(self, x, cos, sin, kv_cache, attention, meta) -> torch.Tensor:
        h = cpu_fused_ops.add_rms_norm(x, None, self.input_norm, self.eps)
        h = cpu_fused_ops.add_rms_norm(x, self.attend(h, cos, sin, kv_cache, attention, meta), self.pre_ff_norm,
                                       self.eps, delta_weight=self.post_attn_norm)
        cpu_fused_ops.add_rms_norm(x, self.down.linear_bf16(cpu_fused_ops.gelu_tanh_mul(self.gate_up.linear_bf16(h))),
                                   None, self.eps, delta_weight=self.post_ff_norm)
        return x


def _fused(layer, form: Callable[[object], Optional[type]], weight: Callable):
    kind = form(layer)
    return None if kind is None else kind.from_layer(layer, weight)


def build(model, form: Callable[[object], Optional[type]], weight: Callable = bf16_weight) -> Optional[list]:
    """Every layer of `model` in fused form, or None where one does not fit (or the kernels do
    not build, or NIGHTSHIFT_CPU_FUSED_OPS=0): the model then runs its torch layers. `form` gives a
    layer's fused class (FusedCpuLayer, FusedGemmaCpuLayer, models/fused_moe_cpu_layer.py's
    FusedMoeCpuLayer) or None: the model's own judgement (LlamaForCausalLM.fused_cpu_form);
    `weight` what computes each projection (``bf16_weight``: bfloat16 in and out for every step)."""
    if os.environ.get(ENV, "1") == "0" or model.dtype != torch.float32 or model.embed_tokens.device.type != "cpu":
        return None
    layers = [_fused(layer, form, weight) for layer in model.layers]
    if not layers or any(layer is None for layer in layers) or cpu_fused_ops.load() is None:
        return None
    return layers

"""A small step's whole stack of fused CPU layers in one C call: ``FusedCpuStack``.

A batch-1 decode step of an INT4 model on the CPU runs every Llama-shaped layer as nine kernel calls
(models/fused_cpu_layer.py: two norms, the four projections on the 4-bit x bfloat16 kernel of
quant/cpu_w4_bf16.py, RoPE and the K/V store, attention, SiLU-and-mul) plus a cast and an add: ~330
calls a step for the default model's 30 layers, each with a few microseconds of Python around it
(argument checks, new output tensors, the ctypes call) against kernels that take 1 to 25 us. This
module makes the same calls, with the same arguments in the same order, from one C loop over the
layers (``run_stack`` below calls the other libraries' kernels through their addresses), so a step
computes the same bits with one call from Python instead of ~330.

It runs a step where every layer is the plain ``FusedCpuLayer`` (Llama, Qwen2's bias, Qwen3's q/k
norms: everything ``rope_store`` takes) or Gemma 2/3's ``FusedGemmaCpuLayer`` (its sandwich norms,
GeGLU, windows and soft-capping), every projection an INT4 layer whose small steps run our
W4 x bfloat16 kernel (``Int4Linear.small_step_weight``: a CPU with AVX-512 BF16 or AVX2), and the
step has at most as many rows as those layers' small steps (``cpu_int4_max_rows``, 8 by default);
every other step, and every other model, runs the layers from Python as before.
``NIGHTSHIFT_CPU_FUSED_STACK=0`` turns it off.

Under the bf16 CPU math the stack runs the model's own fused layers (a bfloat16 K/V pool). Under the
float32 math (every AVX2 CPU) the model runs its torch layers over a float32 pool, and the stack
runs fused forms of them that only it uses (``build``): their small steps already rounded each
projection's input and output to bfloat16 for the 4-bit kernel, so the stack computes the same
values up to float32 summation order, over the same float32 pool (rope_store and the attention
kernel read and write float32 there).
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from nightshift.engine.kernels import cpu_fused_ops, cpu_paged_attention
from nightshift.engine.kernels.c_library import OPTIMIZE, load_library
from nightshift.engine.models import fused_cpu_layer
from nightshift.engine.models.fused_cpu_layer import FusedCpuLayer, FusedGemmaCpuLayer
from nightshift.engine.quant import cpu_w4_bf16
from nightshift.engine.quant.int4_linear import Int4Linear

ENV = "NIGHTSHIFT_CPU_FUSED_STACK"
FORMS = (FusedCpuLayer, FusedGemmaCpuLayer)      # the layer forms run_stack runs (not the experts' one)

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* the kernels' signatures (kernels/cpu_fused_ops.py, kernels/cpu_paged_attention.py,
   quant/cpu_w4_bf16.py) */
typedef void (*norm_fn)(float *, const uint16_t *, const float *, const float *, uint16_t *, int64_t, int64_t, float);
typedef void (*act_fn)(const uint16_t *, uint16_t *, int64_t, int64_t, int64_t);
typedef void (*rope_fn)(const uint16_t *, const float *, const float *, const float *, const int64_t *, void *,
                        void *, float *, const float *, const float *, float, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, float);
typedef void (*attn_fn)(const float *, const void *, const void *, const int32_t *, int64_t, const int32_t *,
                        float *, int64_t, int64_t, int64_t, float, int64_t, float);
typedef void (*gemm_fn)(const uint16_t *, int64_t, int64_t, int64_t, const void *, const void *, uint16_t *, int64_t);

struct kernels { void *norm, *act, *rope, *attn, *gemm; };
struct proj { const void *packed, *scales_mins; int64_t n, k, g; };
struct layer {
    /* mid_norm: the norm before the MLP (Llama's post-attention norm, Gemma's pre-feedforward one);
       attn_delta_w / ff_delta_w: Gemma's post-attention / post-feedforward norms of the sublayers'
       results (NULL: Llama's plain residual adds); gelu: GeGLU (Gemma) or SiLU */
    const float *in_norm, *mid_norm, *attn_delta_w, *ff_delta_w, *qkv_bias, *q_norm, *k_norm;
    float eps, mid_eps, qk_eps, clip, scale, softcap;
    int64_t qk_whole, window, rope, gelu;              /* rope: which of the step's tables */
    struct proj qkv, o, gate_up, down;
    void *k_cache, *v_cache;
};
struct shape { int64_t heads, kv_heads, head_dim, rotary, hidden, inter, kv_bf16, block_size; };
struct step {
    const float *cos[2], *sin[2];
    const int64_t *slots; const int32_t *tables, *lens; int64_t width, rows;
    uint16_t *h, *qkv, *att16, *o, *gate_up, *act, *down; float *q, *att;
};

/* round to nearest even, NaN to the quiet NaN: as torch's float -> bfloat16 */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}

/* x [rows, hidden] float32, the residual stream, through every layer in place: per layer what
   FusedCpuLayer.__call__ (or FusedGemmaCpuLayer.__call__) does, call for call */
void run_stack(const struct kernels *k, const struct shape *s, const struct layer *layers, int64_t count,
               float *x, const struct step *st) {
    const norm_fn norm = (norm_fn)k->norm; const act_fn act = (act_fn)k->act; const rope_fn rope = (rope_fn)k->rope;
    const attn_fn attn = (attn_fn)k->attn; const gemm_fn gemm = (gemm_fn)k->gemm;
    const int64_t T = st->rows, H = s->heads, D = s->head_dim, hidden = s->hidden;
    for (int64_t i = 0; i < count; i++) {
        const struct layer *L = layers + i;
        norm(x, 0, 0, L->in_norm, st->h, T, hidden, L->eps);
        gemm(st->h, T, hidden, L->qkv.g, L->qkv.packed, L->qkv.scales_mins, st->qkv, L->qkv.n);
        rope(st->qkv, L->qkv_bias, st->cos[L->rope], st->sin[L->rope], st->slots, L->k_cache, L->v_cache, st->q,
             L->q_norm, L->k_norm, L->qk_eps, T, H, s->kv_heads, D, s->rotary, s->kv_bf16, L->qk_whole, L->clip);
        attn(st->q, L->k_cache, L->v_cache, st->tables, st->width, st->lens, st->att, T, s->kv_heads,
             s->block_size, L->scale, L->window, L->softcap);
        for (int64_t j = 0; j < T * H * D; j++) st->att16[j] = f32_to_bf16(st->att[j]);
        gemm(st->att16, T, H * D, L->o.g, L->o.packed, L->o.scales_mins, st->o, L->o.n);
        norm(x, st->o, L->attn_delta_w, L->mid_norm, st->h, T, hidden, L->mid_eps);
        gemm(st->h, T, hidden, L->gate_up.g, L->gate_up.packed, L->gate_up.scales_mins, st->gate_up, L->gate_up.n);
        act(st->gate_up, st->act, T, s->inter, L->gelu);
        gemm(st->act, T, s->inter, L->down.g, L->down.packed, L->down.scales_mins, st->down, L->down.n);
        if (L->ff_delta_w) norm(x, st->down, L->ff_delta_w, 0, 0, T, hidden, L->eps);
        else for (int64_t j = 0; j < T * hidden; j++) x[j] += bf16_to_f32(st->down[j]);
    }
}
"""

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [("norm", _P), ("act", _P), ("rope", _P), ("attn", _P), ("gemm", _P)]


class _Proj(ctypes.Structure):
    _fields_ = [("packed", _P), ("scales_mins", _P), ("n", _I), ("k", _I), ("g", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _P), ("mid_norm", _P), ("attn_delta_w", _P), ("ff_delta_w", _P), ("qkv_bias", _P),
                ("q_norm", _P), ("k_norm", _P),
                ("eps", _F), ("mid_eps", _F), ("qk_eps", _F), ("clip", _F), ("scale", _F), ("softcap", _F),
                ("qk_whole", _I), ("window", _I), ("rope", _I), ("gelu", _I),
                ("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
                ("k_cache", _P), ("v_cache", _P)]


class _Shape(ctypes.Structure):
    _fields_ = [("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("rotary", _I), ("hidden", _I), ("inter", _I),
                ("kv_bf16", _I), ("block_size", _I)]


class _Step(ctypes.Structure):
    _fields_ = [("cos", _P * 2), ("sin", _P * 2), ("slots", _P), ("tables", _P), ("lens", _P), ("width", _I),
                ("rows", _I), ("h", _P), ("qkv", _P), ("att16", _P), ("o", _P), ("gate_up", _P), ("act", _P),
                ("down", _P), ("q", _P), ("att", _P)]


_lib: Optional[ctypes.CDLL] = None
_loaded = False


def load() -> Optional[ctypes.CDLL]:
    """The stack's library, built on first use; None where it cannot be built."""
    global _lib, _loaded
    if not _loaded:
        lib = load_library("cpu_fused_stack", SOURCE, OPTIMIZE)
        if lib is not None:
            lib.run_stack.argtypes = [_P, _P, _P, _I, _P, _P]
            lib.run_stack.restype = None
        _lib, _loaded = lib, True
    return _lib


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class FusedCpuStack:
    """The model's fused layers (each a ``FusedCpuLayer`` or a ``FusedGemmaCpuLayer``) run by
    ``run_stack``; ``runs`` says whether a step of that many rows goes through it, ``__call__`` runs
    it (the residual stream updated in place and returned). The weights' kernel forms are read when
    first needed and again whenever a layer has rebuilt them (a move or cast of the model, a new
    weight)."""

    def __init__(self, model, layers: list):
        config = model.config
        self.model, self.layers = model, layers
        self.projections: list[Int4Linear] = [p for layer in layers for p in (layer.qkv, layer.o, layer.gate_up,
                                                                            layer.down)]
        self.rope_names = sorted(set(model.layer_rope))
        rotary = model.rotary[self.rope_names[0]].cos.shape[-1]          # RoPE dims per head (partial rotary)
        self.shape = _Shape(config.num_heads, config.num_kv_heads, config.head_dim, rotary, config.hidden_size,
                            config.intermediate_size, 0, 0)
        self._kernels: Optional[_Kernels] = None
        self._weights: list = []
        self._table: Optional[ctypes.Array] = None
        self._pool: Optional[list] = None          # the runner's kv_caches the table points into
        self._buffers: dict[str, torch.Tensor] = {}

    def runs(self, rows: int) -> bool:
        """Whether a step of `rows` rows goes through the stack: as many as the layers' small steps
        take (read each step, as the layers read their own bound on each call)."""
        return 0 < rows <= min(p.cpu_int4_max_rows for p in self.projections)

    def _projection(self, module: Int4Linear):
        weight = module.small_step_weight()
        self._weights.append(weight)
        return _Proj(weight.packed.data_ptr(), weight.scales_mins.data_ptr(), weight.out_features,
                     weight.in_features, weight.group_size)

    def _build(self, kv_caches: list) -> None:
        """The layer table: every layer's norms, projections' packed weights and K/V pools."""
        k_cache = kv_caches[0][0]
        group = self.shape.heads // self.shape.kv_heads
        attention = cpu_paged_attention.load(group, self.shape.head_dim, kv_dtype=k_cache.dtype)
        fused = cpu_fused_ops.load()
        self._kernels = _Kernels(_address(fused, "add_rms_norm"), _address(fused, "act_mul"),
                                 _address(fused, "rope_store"), _address(attention, "paged_attention_f32"),
                                 _address(cpu_w4_bf16.load(), "w4_bf16_gemm"))
        self.shape.kv_bf16 = int(k_cache.dtype == torch.bfloat16)
        self.shape.block_size = k_cache.shape[1]
        self._weights = []
        table = (_Layer * len(self.layers))()
        for entry, layer, (k, v), rope in zip(table, self.layers, kv_caches, self.model.layer_rope):
            q_norm, k_norm, qk_eps = layer.qk_norm if layer.qk_norm is not None else (None, None, 0.0)
            entry.in_norm, entry.eps = layer.input_norm.data_ptr(), layer.eps
            if type(layer) is FusedGemmaCpuLayer:
                entry.mid_norm, entry.mid_eps, entry.gelu = layer.pre_ff_norm.data_ptr(), layer.eps, 1
                entry.attn_delta_w, entry.ff_delta_w = layer.post_attn_norm.data_ptr(), layer.post_ff_norm.data_ptr()
            else:
                entry.mid_norm, entry.mid_eps = layer.post_norm.data_ptr(), layer.post_eps
            entry.qkv_bias, entry.q_norm, entry.k_norm = _ptr(layer.qkv_bias), _ptr(q_norm), _ptr(k_norm)
            entry.qk_eps = qk_eps
            entry.clip, entry.scale, entry.softcap = layer.clip or 0.0, layer.scale, layer.softcap or 0.0
            entry.qk_whole = int(q_norm is not None and q_norm.shape != (self.shape.head_dim,))
            entry.window, entry.rope = layer.window or 0, self.rope_names.index(rope)
            entry.qkv, entry.o = self._projection(layer.qkv), self._projection(layer.o)
            entry.gate_up, entry.down = self._projection(layer.gate_up), self._projection(layer.down)
            entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
        self._table, self._pool = table, kv_caches

    def _stale(self, kv_caches: list) -> bool:
        if self._table is None or kv_caches is not self._pool:      # held, so never another list at its id
            return True
        return any(p.small_step_weight() is not w for p, w in zip(self.projections, self._weights))

    def _buffer(self, name: str, size: int, dtype: torch.dtype) -> int:
        """A scratch buffer of at least `size` elements, kept between steps (the stack returns none of them)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < size:
            buffer = self._buffers[name] = torch.empty(size, dtype=dtype)
        return buffer.data_ptr()

    def __call__(self, x: torch.Tensor, rope: dict, kv_caches: list, meta) -> torch.Tensor:
        """`x` `[T, hidden]` float32 (contiguous) through every layer, in place; `rope`: the step's
        (cos, sin) tables by name, `meta`: the CPU kernel backend's metadata of the step."""
        if self._stale(kv_caches):
            self._build(kv_caches)
        rows, s = x.shape[0], self.shape
        q_size, qkv_size = s.heads * s.head_dim, (s.heads + 2 * s.kv_heads) * s.head_dim
        tables = [(rope[name][0].reshape(rows, s.rotary).contiguous(),
                   rope[name][1].reshape(rows, s.rotary).contiguous()) for name in self.rope_names]
        step = _Step()
        for i, (cos, sin) in enumerate(tables):
            step.cos[i], step.sin[i] = cos.data_ptr(), sin.data_ptr()
        step.slots, step.tables, step.lens = (meta.slot_mapping.data_ptr(), meta.rows.block_tables.data_ptr(),
                                              meta.rows.context_lens.data_ptr())
        step.width, step.rows = meta.rows.block_tables.shape[1], rows
        bf16, f32 = torch.bfloat16, torch.float32
        step.h, step.qkv = self._buffer("h", rows * s.hidden, bf16), self._buffer("qkv", rows * qkv_size, bf16)
        step.att16, step.o = self._buffer("att16", rows * q_size, bf16), self._buffer("o", rows * s.hidden, bf16)
        step.gate_up, step.act = (self._buffer("gate_up", rows * 2 * s.inter, bf16),
                                  self._buffer("act", rows * s.inter, bf16))
        step.down = self._buffer("down", rows * s.hidden, bf16)
        step.q, step.att = self._buffer("q", rows * q_size, f32), self._buffer("att", rows * q_size, f32)
        load().run_stack(ctypes.addressof(self._kernels), ctypes.addressof(self.shape),
                         ctypes.addressof(self._table), len(self.layers), x.data_ptr(), ctypes.addressof(step))
        return x


def small_step_projection(module, bias_allowed: bool):
    """The projection itself where ``run_stack`` can compute it (an INT4 layer whose small steps run
    our W4 x bfloat16 kernel, with a bias only where the layer form takes one), else None: the
    ``weight`` the stack's own fused layers are built with (fused_cpu_layer.build)."""
    if type(module) is not Int4Linear or not module.small_steps_on_w4_bf16():
        return None
    return module if module.bias is None or bias_allowed else None


def build(model) -> Optional[FusedCpuStack]:
    """The stack for `model`, or None where it does not apply (the module docstring): a layer of
    another form, a projection whose small steps another kernel runs, a library that does not build,
    or NIGHTSHIFT_CPU_FUSED_STACK=0. Its layers are the model's fused layers where it runs them for
    every step; else (the float32 CPU math) fused forms of its torch layers that only the stack runs,
    over the model's float32 K/V pool."""
    if os.environ.get(ENV, "1") == "0":
        return None
    layers = model.fused_layers
    if layers is None:
        def form(layer):
            kind = model.fused_cpu_form(layer)
            return kind if kind in FORMS else None
        layers = fused_cpu_layer.build(model, form, small_step_projection)
    if not layers or any(type(layer) not in FORMS for layer in layers):
        return None
    for layer in layers:
        for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if small_step_projection(projection, True) is None:
                return None
    if load() is None or cpu_fused_ops.load() is None:
        return None
    return FusedCpuStack(model, layers)

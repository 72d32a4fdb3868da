"""The small ops of a decoder layer on the CPU's bf16 math, fused into C kernels.

With the bf16 CPU math (engine/layers/cpu_math.py) every linear layer takes bfloat16 activations
and gives bfloat16 results; in plain torch each of them is cast on the way in and back to float32
on the way out, and the norms, RoPE, the K/V store and SiLU-and-mul each run as several tensor
ops. On the standard 256-row decode step that was ~40 ms of casts and ~30 ms of small ops in a
~365 ms step (torch.profiler, AVX-512 Zen 4). These kernels do each of those in one pass, reading
the linears' bfloat16 results and writing the next linear's bfloat16 inputs, with every sum and
product in float32 as the torch path computes them (values rounded to bfloat16 at the same
places: a linear's input and output):

* ``add_rms_norm``: the residual stream ``x`` (float32) += a sublayer's bfloat16 result (RMS-
  normalised first where the layer has a post-norm: Gemma's sandwich norms), then
  ``weight * x / rms(x)`` rounded to bfloat16 (the next linear's input);
* ``rope_store``: the q/k/v projection's bfloat16 result (+ its float32 bias) -> q and k heads
  RMS-normalised where the layer has q/k norms (per head: Qwen3, Gemma 3; over the whole
  projection, then clamped where the config clips: OLMoE), rotated (RoPE, partial rotary
  included), k and v written into the paged K/V pool at the rows' slots; q out as float32 for
  attention, which reads K/V from the pool;
* ``silu_mul`` / ``gelu_tanh_mul``: ``act(gate) * up`` of the gate/up projection's result, rounded
  to bfloat16;
* ``moe_combine``: a mixture-of-experts layer's weighted sum of each token's experts' bfloat16
  outputs, added to the residual stream (one pass, no gathered float32 copy).

Built on first use with the system C compiler through kernels/c_library.py, like the attention
kernel; ``load()`` is None where that fails, and the model keeps its torch ops
(models/fused_cpu_layer.py decides). Rows run in parallel (OpenMP); each row's result depends on
that row alone.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from nightshift.engine.kernels.c_library import EXP16_AVX512, OPTIMIZE, load_library

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
""" + EXP16_AVX512 + r"""

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
/* round to nearest even, NaN to the quiet NaN: as torch's float -> bfloat16 */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* x [T, H] float32, updated in place where delta != NULL: x += delta, or with delta_w [H] float32
   x += delta_w * delta * rsqrt(mean(delta^2) + eps) (Gemma's post-attention / post-feedforward
   norms); delta [T, H] bf16. Then, where out != NULL: out [T, H] bf16 = w * x * rsqrt(mean(x^2) + eps). */
void add_rms_norm(float *x, const uint16_t *delta, const float *delta_w, const float *w, uint16_t *out,
                  int64_t T, int64_t H, float eps) {
    #pragma omp parallel for schedule(static) if (T > 1)      /* one row: no team to wake */
    for (int64_t t = 0; t < T; t++) {
        float *xt = x + t * H;
        if (delta) {
            const uint16_t *dt = delta + t * H;
            if (delta_w) {
                float ds = 0.f;
                #pragma omp simd reduction(+:ds)
                for (int64_t i = 0; i < H; i++) { const float d = bf16_to_f32(dt[i]); ds += d * d; }
                const float dinv = 1.f / sqrtf(ds / (float)H + eps);
                #pragma omp simd
                for (int64_t i = 0; i < H; i++) xt[i] += delta_w[i] * (bf16_to_f32(dt[i]) * dinv);
            } else {
                #pragma omp simd
                for (int64_t i = 0; i < H; i++) xt[i] += bf16_to_f32(dt[i]);
            }
        }
        if (!out) continue;
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < H; i++) ss += xt[i] * xt[i];
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        uint16_t *ot = out + t * H;
        #pragma omp simd
        for (int64_t i = 0; i < H; i++) ot[i] = f32_to_bf16(w[i] * (xt[i] * inv));
    }
}

#ifdef __AVX512F__
/* 16 bfloat16 <-> float32: the bits of bf16_to_f32 and f32_to_bf16 above (with avx512_bf16's one
   instruction, but for a NaN's payload and float32 denormals, which it rounds to zero) */
static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void f32x16_to_bf16(uint16_t *p, __m512 x) {
#ifdef __AVX512BF16__
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
#else
    const __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    r = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
#endif
}
#endif

/* gate_up [T, 2I] bf16 (gate first) -> out [T, I] bf16 = act(gate) * up, act silu or (gelu != 0)
   the tanh-approximated gelu (Gemma's GeGLU); SiLU's e^-x inline on AVX-512 (exp16) */
void act_mul(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t I, int64_t gelu) {
    #pragma omp parallel for schedule(static) if (T > 1)      /* one row: no team to wake */
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * I, *u = g + I;
        uint16_t *o = out + t * I;
        if (gelu) {
            #pragma omp simd
            for (int64_t i = 0; i < I; i++) {
                const float a = bf16_to_f32(g[i]);
                const float act = 0.5f * a * (1.f + tanhf(0.7978845608028654f * (a + 0.044715f * a * a * a)));
                o[i] = f32_to_bf16(act * bf16_to_f32(u[i]));
            }
        } else {
            /* silu(a) = a * sigmoid(a), sigmoid from t = e^-|a| (never above 1): 1 / (1 + t) for a >= 0,
               t / (1 + t) below. a / (1 + e^-a) overflowed for a gate below -88.7: e^-a = inf, and a
               vector division under -ffast-math is a reciprocal estimate refined by a Newton step,
               which turns 1 / inf into NaN (the whole row's next layers NaN with it). */
            int64_t i = 0;
#ifdef __AVX512F__
            for (; i + 16 <= I; i += 16) {
                const __m512 a = bf16x16_to_f32(g + i);
                const __m512 t = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a)));
                const __mmask16 negative = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ);
                const __m512 num = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), negative, t);
                const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.f), t));
                f32x16_to_bf16(o + i, _mm512_mul_ps(_mm512_mul_ps(a, sig), bf16x16_to_f32(u + i)));
            }
#endif
            for (int64_t j = i; j < I; j++) {
                const float a = bf16_to_f32(g[j]), t = expf(-fabsf(a));
                o[j] = f32_to_bf16(a * ((a < 0.f ? t : 1.f) / (1.f + t)) * bf16_to_f32(u[j]));
            }
        }
    }
}

/* x [T, H] float32 += for each token t, sum over its k slots j (in slot order) of
   weights[t, j] * out[pos[t * k + j]] (out [T * k, H] bf16: the experts' outputs in their sorted
   order; pos: each assignment's row in it) -- a mixture-of-experts layer's weighted sum */
void moe_combine(float *x, const uint16_t *out, const int64_t *pos, const float *weights,
                 int64_t T, int64_t H, int64_t k) {
    #pragma omp parallel for schedule(static) if (T > 1)      /* one row: no team to wake */
    for (int64_t t = 0; t < T; t++) {
        float *xt = x + t * H;
        for (int64_t i = 0; i < H; i++) {
            float acc = 0.f;
            for (int64_t j = 0; j < k; j++)
                acc += weights[t * k + j] * bf16_to_f32(out[pos[t * k + j] * H + i]);
            xt[i] += acc;
        }
    }
}

/* x [n] into the pool at element `at` (float32, or bfloat16 where bf16) */
static inline void store_row(void *pool, int64_t at, const float *x, int64_t n, int64_t bf16) {
    if (bf16) {
        uint16_t *p = (uint16_t *)pool + at;
        for (int64_t i = 0; i < n; i++) p[i] = f32_to_bf16(x[i]);
    } else {
        memcpy((float *)pool + at, x, sizeof(float) * n);
    }
}

/* qkv [T, (H + 2 KVH) * D] bf16 (+ bias [(H + 2 KVH) * D] float32 or NULL); cos, sin [T, R]
   (R rotary dims, the first R of each head; cos/sin repeat their halves). Where q_norm and k_norm
   are given, q and k are RMS-normalised with them first (w * x / sqrt(mean(x^2) + qk_eps)): every
   head on its own ([D] weights: Qwen3, Gemma 3), or, with qk_whole, all q heads as one vector and
   all k heads as another ([H * D] and [KVH * D] weights: OLMoE). Where clip > 0, q, k and v are
   then clamped to [-clip, clip] (OLMoE's clip_qkv). q and k heads rotated
   (x * cos + rotate_half(x) * sin); q -> q_out [T, H, D]; k, v -> the pool at slots[t]
   (k_cache, v_cache [slots, KVH, D], float32, or bfloat16 where kv_bf16). */
static inline void rms_scale(float *x, const float *w, int64_t n, float eps) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = w[i] * (x[i] * inv);
}

void rope_store(const uint16_t *qkv, const float *bias, const float *cos_t, const float *sin_t,
                const int64_t *slots, void *k_cache, void *v_cache, float *q_out,
                const float *q_norm, const float *k_norm, float qk_eps,
                int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t R, int64_t kv_bf16,
                int64_t qk_whole, float clip) {
    const int64_t width = (H + 2 * KVH) * D, half = R / 2;
    #pragma omp parallel for schedule(static) if (T > 1)      /* one row: no team to wake */
    for (int64_t t = 0; t < T; t++) {
        float row[width];
        const uint16_t *src = qkv + t * width;
        for (int64_t i = 0; i < width; i++) row[i] = bf16_to_f32(src[i]) + (bias ? bias[i] : 0.f);
        const float *c = cos_t + t * R, *s = sin_t + t * R;
        if (q_norm && qk_whole) {
            rms_scale(row, q_norm, H * D, qk_eps);
            rms_scale(row + H * D, k_norm, KVH * D, qk_eps);
        }
        if (clip > 0.f)
            for (int64_t i = 0; i < width; i++) row[i] = row[i] < -clip ? -clip : (row[i] > clip ? clip : row[i]);
        for (int64_t head = 0; head < H + KVH; head++) {
            float *x = row + head * D, rot[R];
            const float *w = head < H ? q_norm : k_norm;
            if (w && !qk_whole) rms_scale(x, w, D, qk_eps);
            for (int64_t i = 0; i < half; i++) {
                rot[i] = x[i] * c[i] - x[i + half] * s[i];
                rot[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
            }
            memcpy(x, rot, sizeof(float) * R);
        }
        memcpy(q_out + t * H * D, row, sizeof(float) * H * D);
        const int64_t kv = KVH * D;
        store_row(k_cache, slots[t] * kv, row + H * D, kv, kv_bf16);
        store_row(v_cache, slots[t] * kv, row + (H + KVH) * D, kv, kv_bf16);
    }
}
"""
FLAGS = [*OPTIMIZE, "-ffast-math"]

_lib: Optional[ctypes.CDLL] = None
_loaded = False
_P = ctypes.c_void_p
_I = ctypes.c_int64


def load() -> Optional[ctypes.CDLL]:
    """The kernels' library, built on first use; None where it cannot be built."""
    global _lib, _loaded
    if not _loaded:
        lib = load_library("cpu_fused_ops", SOURCE, FLAGS)
        if lib is not None:
            lib.add_rms_norm.argtypes = [_P] * 5 + [_I, _I, ctypes.c_float]
            lib.act_mul.argtypes = [_P, _P, _I, _I, _I]
            lib.rope_store.argtypes = [_P] * 10 + [ctypes.c_float] + [_I] * 7 + [ctypes.c_float]
            lib.moe_combine.argtypes = [_P] * 4 + [_I] * 3
            for fn in (lib.add_rms_norm, lib.act_mul, lib.rope_store, lib.moe_combine):
                fn.restype = None
        _lib, _loaded = lib, True
    return _lib


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def add_rms_norm(x: torch.Tensor, delta: Optional[torch.Tensor], weight: Optional[torch.Tensor], eps: float,
                 delta_weight: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """`x` `[T, H]` float32 += `delta` (bfloat16, or None: x unchanged), in place, the delta first
    RMS-normalised and scaled by `delta_weight` where given (Gemma's post-norms); returns
    ``weight * rms_norm(x)`` as bfloat16 `[T, H]`, or None without a weight."""
    assert x.dtype == torch.float32 and x.is_contiguous()
    assert delta is None or (delta.dtype == torch.bfloat16 and delta.is_contiguous() and delta.shape == x.shape)
    for w in (weight, delta_weight):
        assert w is None or (w.dtype == torch.float32 and w.is_contiguous() and w.shape == x.shape[1:])
    out = None if weight is None else torch.empty(x.shape, dtype=torch.bfloat16)
    load().add_rms_norm(x.data_ptr(), _ptr(delta), _ptr(delta_weight), _ptr(weight), _ptr(out), x.shape[0],
                        x.shape[1], eps)
    return out


def _act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    assert gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous()
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.bfloat16)
    load().act_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, int(gelu))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gate_up` `[T, 2I]` bfloat16 (gate, then up) -> ``silu(gate) * up`` `[T, I]` bfloat16."""
    return _act_mul(gate_up, gelu=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gate_up` `[T, 2I]` bfloat16 -> ``gelu_tanh(gate) * up`` `[T, I]` bfloat16 (Gemma's GeGLU)."""
    return _act_mul(gate_up, gelu=True)


def moe_combine(x: torch.Tensor, out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A mixture-of-experts layer's weighted sum into the residual stream, in place: `x` `[T, H]`
    float32 += ``sum_j weights[t, j] * out[row of (t, j)]`` for each token t, its k slots in slot
    order. `out` `[T * k, H]` bfloat16: the experts' outputs sorted by expert, `order` (int64) the
    sorted position's assignment index ``t * k + j`` (models/moe.py SparseMoeBlock.expert_outputs);
    `weights` `[T, k]` float32, the router's."""
    rows, hidden = x.shape
    k = weights.shape[1]
    assert x.dtype == torch.float32 and x.is_contiguous() and weights.shape[0] == rows
    assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.shape == (rows * k, hidden)
    assert order.dtype == torch.int64 and order.shape == (rows * k,)
    position = torch.empty_like(order)
    position[order] = torch.arange(rows * k)                  # each assignment's row in `out`
    weights = weights.float().contiguous()
    load().moe_combine(x.data_ptr(), out.data_ptr(), position.data_ptr(), weights.data_ptr(), rows, hidden, k)
    return x


def rope_store(qkv: torch.Tensor, bias: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
               slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
               qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
               clip: Optional[float] = None) -> torch.Tensor:
    """`qkv` `[T, (H + 2 KVH) * D]` bfloat16 (+ `bias`) -> q `[T, H, D]` float32, rotated; k
    (rotated) and v written into the pools `[blocks, block_size, KVH, D]` (float32 or bfloat16) at
    `slots` `[T]` (int64), where the attention kernel reads them. `cos`/`sin`: the rows' RoPE tables
    `[T, ..., R]` float32, R <= D rotary dims. `qk_norm`: (q weight, k weight, eps), RMSNorms before
    RoPE: of every q and k head with weights `[D]` float32 (Qwen3), or of all q heads as one vector
    and all k heads as another with weights `[H * D]` and `[KVH * D]` (OLMoE). `clip`: q, k and v
    clamped to [-clip, clip] after the norms (OLMoE's clip_qkv)."""
    kv_heads, dim = k_cache.shape[-2:]
    rows = qkv.shape[0]
    rotary = cos.shape[-1]
    assert qkv.dtype == torch.bfloat16 and qkv.is_contiguous() and qkv.shape[1] == (num_heads + 2 * kv_heads) * dim
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slots.dtype == torch.int64 and cos.dtype == sin.dtype == torch.float32 and rotary % 2 == 0
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    cos, sin, slots = cos.reshape(rows, rotary).contiguous(), sin.reshape(rows, rotary).contiguous(), slots.contiguous()
    q_norm, k_norm, qk_eps = qk_norm if qk_norm is not None else (None, None, 0.0)
    whole = q_norm is not None and q_norm.shape != (dim,)
    for w, heads in ((q_norm, num_heads), (k_norm, kv_heads)):
        assert w is None or (w.dtype == torch.float32 and w.is_contiguous()
                             and w.shape == ((heads * dim,) if whole else (dim,)))
    assert clip is None or clip > 0
    q = torch.empty(rows, num_heads, dim)
    load().rope_store(qkv.data_ptr(), _ptr(bias), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                      k_cache.data_ptr(), v_cache.data_ptr(), q.data_ptr(), _ptr(q_norm), _ptr(k_norm), qk_eps,
                      rows, num_heads, kv_heads, dim, rotary, int(k_cache.dtype == torch.bfloat16), int(whole),
                      clip or 0.0)
    return q

"""ModelConfig: the shape of a decoder (Llama family, Qwen3, Gemma 2/3, Phi-3, and the mixture-of-
experts decoders Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE), read from GGUF
metadata or HF config.json. A config field the engine cannot honour is refused here with a
ValueError naming it: a model is never loaded approximately."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3",
                           "mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
# mixture-of-experts families the engine does not run (grouped routing, several shared experts, ...):
# refused by name rather than as an unknown architecture
UNSUPPORTED_MOE_ARCHITECTURES = ("deepseek_v2", "deepseek_v3", "qwen3_next", "phimoe", "granitemoe",
                                 "jamba", "dbrx", "llama4_text", "gpt_oss")
GGUF_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "phi3",   # llama.cpp's names
                      "qwen3moe", "olmoe", "qwen2moe")      # (and Mixtral: "llama" with llama.expert_count)
SUPPORTED_ROPE_SCALING = (None, "default", "linear", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelConfig:
    architecture: str                 # one of SUPPORTED_ARCHITECTURES (models/__init__.py picks the class)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False      # q/k/v biases (Qwen2)
    rope_scaling: Optional[dict[str, Any]] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    # --- the differences of the newer architectures (neutral defaults: the Llama block) ---
    qk_norm: bool = False             # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    sliding_window: Optional[int] = None   # keys of the last `sliding_window` positions, on sliding layers
    layer_types: Optional[list[str]] = None   # per layer "full_attention" | "sliding_attention"; None: all full
    attn_logit_softcapping: Optional[float] = None    # scores -> c * tanh(scores / c) (Gemma 2)
    final_logit_softcapping: Optional[float] = None   # logits -> c * tanh(logits / c) (Gemma 2)
    query_pre_attn_scalar: Optional[float] = None     # attention scale = this ** -0.5 (Gemma)
    rope_local_base_freq: Optional[float] = None      # RoPE base of sliding layers, no scaling (Gemma 3)
    partial_rotary_factor: float = 1.0                # RoPE on the first head_dim * this dims (Phi-3)
    qk_norm_per_head: bool = True     # qk_norm over each head (Qwen3) or over the whole q / k projection (OLMoE)
    clip_qkv: Optional[float] = None  # q, k, v clamped to [-c, c] after the projections (OLMoE)
    # --- mixture of experts (models/moe.py); num_experts 0: every layer a dense MLP ---
    num_experts: int = 0
    num_experts_per_tok: int = 0      # top-k experts per token
    moe_intermediate_size: Optional[int] = None       # each expert's width (None: intermediate_size)
    norm_topk_prob: bool = True       # the chosen k router probabilities renormalised to sum to 1
    dense_mlp_layers: list[int] = field(default_factory=list)   # layers with a dense MLP instead of experts
    # one shared expert beside the routed ones, every token through it, scaled by
    # sigmoid(shared_expert_gate . x) (Qwen2-MoE); None: no shared expert
    shared_expert_intermediate_size: Optional[int] = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        kind = rope_scaling_type(self.rope_scaling)
        if kind not in SUPPORTED_ROPE_SCALING:
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3, longrope")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(f"layer_types must be {self.num_layers} of {LAYER_TYPES}, got {self.layer_types}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                             f"{self.num_experts}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives an unusable rotary "
                             f"dimension {self.rotary_dim} of head_dim {self.head_dim}")

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim) ** -0.5

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (else a dense MLP of intermediate_size)."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> Optional[int]:
        """The attention window of `layer` (each query sees the last `window` positions, itself
        included), None for full causal attention."""
        return self.sliding_window if self.sliding_window and self.is_sliding(layer) else None

    @property
    def kv_window(self) -> Optional[int]:
        """The span every layer attends within when every layer has a window (the widest of
        them), None when some layer attends to the whole context. Each query at position p then
        reads no key before p - kv_window + 1, so KV blocks wholly before that can be given back
        (Scheduler.complete_step); with a global layer among them nothing can."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return None if not windows or None in windows else max(windows)

    @property
    def needs_masked_attention(self) -> bool:
        """Some layer attends through a window or with soft-capped scores (attention/ backends
        then take their masked path for those layers)."""
        return self.attn_logit_softcapping is not None or \
            any(self.layer_window(i) is not None for i in range(self.num_layers))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def projection_shapes(self) -> tuple[tuple[int, int], ...]:
        """`[out, in]` of every matmul of a forward pass, in order: each layer's fused q|k|v,
        attention output, fused gate|up and down projections (a mixture-of-experts layer: each
        token's top-k experts' ones and the shared expert's, the router and the shared expert's
        gate aside), then the LM head."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes: tuple[tuple[int, int], ...] = ()
        for layer in range(self.num_layers):
            if self.is_moe(layer):
                i = self.expert_intermediate_size
                shapes += ((q + 2 * kv, h), (h, q)) + ((2 * i, h), (h, i)) * self.num_experts_per_tok
                if self.shared_expert_intermediate_size:
                    s = self.shared_expert_intermediate_size
                    shapes += ((2 * s, h), (h, s))
            else:
                i = self.intermediate_size
                shapes += ((q + 2 * kv, h), (h, q), (2 * i, h), (h, i))
        return shapes + ((self.vocab_size, h),)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return cls(**data)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        """From a Hugging Face config.json (Llama, Qwen2, Mistral, Qwen3, Gemma 2, Gemma 3 text, Phi-3,
        and the mixtures of experts of MOE_ARCHITECTURES)."""
        model_type = cfg.get("model_type", "llama")
        if model_type in UNSUPPORTED_MOE_ARCHITECTURES:
            raise ValueError(f"unsupported model architecture {model_type!r}: its mixture of experts (shared "
                             f"experts or its own routing) is not implemented; supported mixtures of experts: "
                             f"{', '.join(MOE_ARCHITECTURES)}")
        if model_type in NEWER_ARCHITECTURES:
            return _from_newer_hf_config(cls, cfg, model_type, name)
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [key for key in required if key not in cfg]
        if missing:
            raise ValueError(f"config.json is missing {', '.join(missing)}")
        rope_scaling = cfg.get("rope_scaling")
        max_positions = cfg.get("max_position_embeddings", 2048)
        # sliding windows as transformers applies them: Mistral's on every layer; Qwen2's where
        # use_sliding_window says, on the layers from max_window_layers on (or as layer_types says)
        window = cfg.get("sliding_window") or None
        layers = cfg["num_hidden_layers"]
        layer_types = None
        if window and model_type == "mistral":
            layer_types = ["sliding_attention"] * layers
        elif window and model_type == "qwen2" and cfg.get("use_sliding_window"):
            layer_types = cfg.get("layer_types") or [
                "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"   # transformers' default
                for i in range(layers)]
        if layer_types is None or "sliding_attention" not in layer_types:
            window = layer_types = None
        rope_theta = cfg.get("rope_theta")
        # transformers 5 moved rope settings into `rope_parameters`
        rope_parameters = cfg.get("rope_parameters")
        if isinstance(rope_parameters, dict):
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
            if rope_parameters.get("rope_type", "default") != "default":
                rope_scaling = rope_parameters
        return cls(
            architecture=model_type,
            num_layers=cfg["num_hidden_layers"],
            **_hf_shape_fields(cfg),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope_scaling=rope_scaling,
            name=name,
            sliding_window=window,
            layer_types=layer_types,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], has_output_weight: bool, name: str = "",
                           config_tensors: Optional[dict[str, list[float]]] = None) -> "ModelConfig":
        """From GGUF key/values (llama.cpp names). `has_output_weight`: the file has an `output.weight`
        tensor; without one the lm_head is tied to the token embedding. `config_tensors`: the
        file's tensors that are config values (gguf_file.CONFIG_TENSORS: Phi-3's LongRoPE factors)."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

        def key(suffix: str, default: Any = ...) -> Any:
            full = f"{arch}.{suffix}"
            if full in meta:
                return meta[full]
            if default is ...:
                raise ValueError(f"GGUF metadata is missing {full!r}")
            return default

        for suffix in _REFUSED_GGUF_KEYS:
            if f"{arch}.{suffix}" in meta:
                raise ValueError(f"GGUF metadata {arch}.{suffix}={meta[f'{arch}.{suffix}']!r} is not supported")
        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        if arch == "phi3":     # partial rotary: rope.dimension_count is the rotated part of each head
            head_dim = int(key("attention.key_length", hidden // heads))
        else:
            head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // heads)))
        rotary_dim = int(key("rope.dimension_count", head_dim))
        if rotary_dim != head_dim and arch != "phi3":
            raise ValueError(f"GGUF metadata {arch}.rope.dimension_count={rotary_dim} differs from the head "
                             f"dimension {head_dim}: partial rotary is supported for phi3 only")
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise ValueError(f"GGUF metadata {arch}.attention.value_length={key('attention.value_length')} "
                             f"differs from the key length {head_dim}")
        vocab = key("vocab_size", None)
        if vocab is None:
            vocab = len(meta["tokenizer.ggml.tokens"])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        layers = int(key("block_count"))
        config_tensors = config_tensors or {}
        moe = _gguf_moe_fields(key, arch)
        if config_tensors and arch != "phi3":
            raise ValueError(f"GGUF tensors {', '.join(config_tensors)} (LongRoPE factors) are supported "
                             f"for phi3 only, not {arch!r}")
        return cls(
            architecture="mixtral" if moe and arch == "llama" else _GGUF_TO_HF_ARCHITECTURE.get(arch, arch),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            intermediate_size=int(key("feed_forward_length")),
            vocab_size=int(vocab),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch in ("qwen2", "qwen2moe"),
            qk_norm=arch in ("qwen3", "gemma3", "qwen3moe", "olmoe"),    # attn_q_norm / attn_k_norm
            rope_scaling=_gguf_rope_scaling(meta, arch, config_tensors),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [int(eos)],
            name=name,
            partial_rotary_factor=rotary_dim / head_dim,
            **_gguf_window_fields(key, arch, layers),
            **(_gguf_gemma_fields(key, arch, layers, hidden, heads, head_dim) if arch in ("gemma2", "gemma3") else {}),
            **moe,
        )


def rope_scaling_type(rope_scaling: Optional[dict[str, Any]]) -> Optional[str]:
    if not rope_scaling:
        return None
    return rope_scaling.get("rope_type") or rope_scaling.get("type")


_GGUF_TO_HF_ARCHITECTURE = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
# GGUF keys (after "<arch>.") that change the model in ways the engine does not implement: refused when present
_REFUSED_GGUF_KEYS = ("attention.scale", "attention.key_length_swa", "attention.value_length_swa",
                      "rope.dimension_count_swa", "rope.scaling.yarn_log_multiplier", "embedding_scale",
                      "residual_scale", "logit_scale", "attention.shared_kv_layers",
                      "expert_group_count", "expert_group_used_count", "expert_chunk_feed_forward_length")
# llama.cpp's Gemma attention scale: 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the 27B models,
# which it knows by their layer count (the file has no query_pre_attn_scalar)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


# the mixtures of experts llama.cpp writes (architecture "llama" with experts: Mixtral), and whether it
# renormalises the top-k router weights when the file has no expert_weights_norm (as its graphs do)
_GGUF_MOE_NORM_TOPK = {"llama": True, "qwen3moe": True, "olmoe": False, "qwen2moe": False}
_GGUF_SOFTMAX_GATING = 1           # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def _gguf_moe_fields(key, arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields (none for a dense file): expert_count, expert_used_count, each
    expert's width (expert_feed_forward_length, else feed_forward_length, as llama.cpp reads it),
    Qwen2-MoE's one shared expert, OLMoE's clamp_kqv; routing other than the softmax top k is refused."""
    experts = int(key("expert_count", 0) or 0)
    if not experts:
        if arch in ("qwen3moe", "olmoe", "qwen2moe"):
            raise ValueError(f"GGUF metadata is missing '{arch}.expert_count'")
        return {}
    if arch not in _GGUF_MOE_NORM_TOPK:
        raise ValueError(f"GGUF metadata {arch}.expert_count={experts}: mixtures of experts load from GGUF "
                         f"architectures {', '.join(_GGUF_MOE_NORM_TOPK)} only")
    gating = int(key("expert_gating_func", _GGUF_SOFTMAX_GATING))
    if gating != _GGUF_SOFTMAX_GATING:
        raise ValueError(f"GGUF metadata {arch}.expert_gating_func={gating} is not supported (softmax routing only)")
    if float(key("expert_weights_scale", 1.0)) != 1.0:
        raise ValueError(f"GGUF metadata {arch}.expert_weights_scale={key('expert_weights_scale')} is not supported")
    fields: dict[str, Any] = {"num_experts": experts, "num_experts_per_tok": int(key("expert_used_count")),
                              "norm_topk_prob": bool(key("expert_weights_norm", _GGUF_MOE_NORM_TOPK[arch]))}
    if key("expert_feed_forward_length", None):
        fields["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
    shared = int(key("expert_shared_count", 1 if arch == "qwen2moe" else 0) or 0)
    if shared and (arch != "qwen2moe" or shared != 1):
        raise ValueError(f"GGUF metadata {arch}.expert_shared_count={shared} is not supported "
                         f"(one shared expert, qwen2moe's, only)")
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length"))
    if arch == "olmoe":
        fields["qk_norm_per_head"] = False
        clamp = key("attention.clamp_kqv", None)
        fields["clip_qkv"] = None if clamp is None else float(clamp)
    elif key("attention.clamp_kqv", None) is not None:
        raise ValueError(f"GGUF metadata {arch}.attention.clamp_kqv is supported for olmoe only")
    return fields


def _gguf_rope_scaling(meta: dict[str, Any], arch: str, config_tensors: dict[str, list[float]]
                       ) -> Optional[dict[str, Any]]:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if config_tensors:     # Phi-3's LongRoPE: short/long per-frequency factors as tensors
        if kind not in (None, "none", "longrope", "su"):
            raise ValueError(f"GGUF rope scaling type {kind!r} beside the LongRoPE factor tensors")
        missing = [k for k in ("short_factor", "long_factor") if k not in config_tensors]
        if missing:
            raise ValueError(f"GGUF LongRoPE without its rope_factors_{missing[0].split('_')[0]}.weight tensor")
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ValueError(f"GGUF LongRoPE factors without {arch}.rope.scaling.original_context_length")
        attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
        return {"rope_type": "longrope", "short_factor": config_tensors["short_factor"],
                "long_factor": config_tensors["long_factor"], "original_max_position_embeddings": int(original),
                "attention_factor": None if attn_factor is None else float(attn_factor)}
    if float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)) != 1.0:
        raise ValueError(f"GGUF metadata {arch}.rope.scaling.attn_factor={meta[f'{arch}.rope.scaling.attn_factor']} "
                         f"is supported only with LongRoPE factor tensors")
    if kind in (None, "none"):
        return None
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


def _gguf_window_fields(key, arch: str, layers: int) -> dict[str, Any]:
    """sliding_window and layer_types as llama.cpp applies `<arch>.attention.sliding_window`: every
    layer (phi3), Gemma 2's even layers, Gemma 3's all but every sliding_window_pattern-th. (The
    Llama-family files' windows are not read, as before Gemma and Phi-3 loaded from GGUF.)"""
    window = int(key("attention.sliding_window", 0) or 0)
    if not window or arch not in ("gemma2", "gemma3", "phi3"):
        return {}
    if arch == "phi3":
        types = [True] * layers
    elif arch == "gemma2":
        types = [i % 2 == 0 for i in range(layers)]
    elif arch == "gemma3":
        pattern = key("attention.sliding_window_pattern", 6)
        types = [bool(x) for x in pattern] if isinstance(pattern, list) else \
            [(i + 1) % int(pattern) != 0 for i in range(layers)]
    else:
        raise ValueError(f"GGUF metadata {arch}.attention.sliding_window={window} is not supported for {arch!r}")
    if len(types) != layers:
        raise ValueError(f"GGUF metadata {arch}.attention.sliding_window_pattern has {len(types)} layers, not {layers}")
    if not any(types):
        return {}
    return {"sliding_window": window,
            "layer_types": ["sliding_attention" if t else "full_attention" for t in types]}


def _gguf_gemma_fields(key, arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 2 / 3's soft-caps, attention scale and (Gemma 3) the sliding layers' RoPE base."""
    caps = {f: (float(key(f)) if key(f, None) else None)
            for f in ("attn_logit_softcapping", "final_logit_softcapping")}
    scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    local = float(key("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None   # llama.cpp's default
    return {**caps, "query_pre_attn_scalar": float(scalar), "rope_local_base_freq": local}


# ---- the newer architectures (config.json of transformers 4.x or 5.x) ------------------------
NEWER_ARCHITECTURES = ("qwen3", "gemma2", "gemma3_text", "phi3") + MOE_ARCHITECTURES
_ACTIVATION = {"qwen3": "silu", "phi3": "silu", "gemma2": "gelu_pytorch_tanh", "gemma3_text": "gelu_pytorch_tanh",
               "mixtral": "silu", "qwen3_moe": "silu", "olmoe": "silu", "qwen2_moe": "silu"}
# config fields of mixture-of-experts checkpoints the engine does not implement: refused when set
# (shared_expert_intermediate_size is Qwen2-MoE's own, refused for the other families)
_UNSUPPORTED_MOE_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                           "moe_shared_expert_intermediate_size", "n_group", "topk_group", "routed_scaling_factor",
                           "first_k_dense_replace", "moe_layer_freq")
_TIED_BY_DEFAULT = ("gemma2", "gemma3_text")


def _hf_rope(params: dict[str, Any], cfg: dict[str, Any], field_name: str) -> tuple[float, Optional[dict[str, Any]]]:
    """(rope_theta, rope_scaling or None) of one rope parameter dict (transformers 5's
    `rope_parameters`, or 4.x's `rope_scaling` plus a theta)."""
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type")
    if kind in (None, "default"):
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    scaling["rope_type"] = "longrope" if kind == "su" else kind
    if scaling["rope_type"] not in SUPPORTED_ROPE_SCALING:
        raise ValueError(f"unsupported {field_name} type {kind!r}; supported: linear, llama3, longrope")
    if scaling["rope_type"] == "longrope":
        scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
            if scaling.get(key) is None:
                raise ValueError(f"{field_name}: longrope scaling without {key}")
    return theta, scaling


def _from_newer_hf_config(cls, cfg: dict[str, Any], model_type: str, name: str) -> ModelConfig:
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [key for key in required if key not in cfg]
    if missing:
        raise ValueError(f"config.json is missing {', '.join(missing)}")
    layers = cfg["num_hidden_layers"]
    gemma = model_type.startswith("gemma")

    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or _ACTIVATION[model_type]
    if activation != _ACTIVATION[model_type]:
        field_name = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
        raise ValueError(f"{model_type}: {field_name}={activation!r} is not supported "
                         f"(only {_ACTIVATION[model_type]!r})")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{model_type}: use_bidirectional_attention=True is not supported (causal LM only)")

    # RoPE: transformers 5 keeps it in `rope_parameters`, per layer type for Gemma 3
    rope_parameters = cfg.get("rope_parameters") or {}
    local_theta = cfg.get("rope_local_base_freq") if model_type == "gemma3_text" else None
    if "full_attention" in rope_parameters or "sliding_attention" in rope_parameters:
        full = rope_parameters.get("full_attention") or {}
        local = rope_parameters.get("sliding_attention")
        if local is not None:
            local_theta, local_scaling = _hf_rope(local, cfg, "rope_parameters.sliding_attention")
            if local_scaling is not None:
                raise ValueError(f"{model_type}: rope_parameters.sliding_attention scaling "
                                 f"{local_scaling['rope_type']!r} is not supported (default RoPE only)")
    elif rope_parameters:
        full = rope_parameters
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 10000.0)}
    rope_theta, rope_scaling = _hf_rope(full, cfg, "rope_scaling")
    partial = full.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    if model_type != "phi3" and partial != 1.0:
        raise ValueError(f"{model_type}: partial_rotary_factor={partial} is not supported for this architecture")

    # which layers attend through a window
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if model_type == "olmoe" and window:
        raise ValueError("olmoe: sliding_window is not supported (OLMoE attends causally over the whole context)")
    if model_type in ("mixtral", "qwen3_moe"):
        # transformers applies the window to every layer (qwen3_moe: only with use_sliding_window)
        if model_type == "qwen3_moe" and not cfg.get("use_sliding_window"):
            window = None
        layer_types = ["sliding_attention"] * layers if window else None
    elif model_type == "qwen2_moe":
        # transformers 5 writes the layer_types it derives (odd-numbered layers below
        # max_window_layers); a config.json without them is refused rather than guessed
        if not cfg.get("use_sliding_window"):
            window = None
        elif layer_types is None or not window:
            missing = "layer_types" if window else "sliding_window"
            raise ValueError(f"qwen2_moe: use_sliding_window=True without {missing} is not supported "
                             f"(which layers slide, or how far, is not stated)")
    elif model_type == "qwen3":
        if not cfg.get("use_sliding_window"):
            window = None
        elif layer_types is None:
            start = cfg.get("max_window_layers", layers)
            layer_types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    elif model_type == "phi3":
        layer_types = ["sliding_attention"] * layers if window else None
    elif layer_types is None and model_type == "gemma2":
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    elif layer_types is None and model_type == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern") or 6
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if layer_types is not None and any(t == "sliding_attention" for t in layer_types) and not window \
            and model_type not in ("qwen3", "qwen2_moe"):
        raise ValueError(f"{model_type}: layer_types has sliding layers but sliding_window is not set")
    if model_type == "gemma3_text" and local_theta is None:
        local_theta = 10000.0          # transformers' default rope_local_base_freq

    moe = _moe_fields(cfg, model_type, layers)
    return cls(
        architecture=model_type,
        num_layers=layers,
        **_hf_shape_fields(cfg),
        rope_theta=rope_theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
        # Qwen2-MoE: q/k/v biases unless qkv_bias says otherwise (transformers 4 had no field: always)
        attention_bias=bool(cfg.get("qkv_bias", True) if model_type == "qwen2_moe" else cfg.get("attention_bias", False)),
        rope_scaling=rope_scaling,
        name=name,
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe"),
        sliding_window=window or None,
        layer_types=layer_types if window else None,
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
        rope_local_base_freq=float(local_theta) if local_theta is not None else None,
        partial_rotary_factor=float(partial),
        **moe,
    )


def _hf_shape_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields every config.json gives alike: widths, heads, norm eps, special tokens."""
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    return {"hidden_size": cfg["hidden_size"], "num_heads": heads,
            "num_kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "intermediate_size": cfg["intermediate_size"], "vocab_size": cfg["vocab_size"],
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6), "bos_token_id": cfg.get("bos_token_id"),
            "eos_token_ids": [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))}


def _moe_fields(cfg: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """The ModelConfig fields of a mixture-of-experts config.json (none for the dense ones)."""
    if model_type not in MOE_ARCHITECTURES:
        return {}
    for key in _UNSUPPORTED_MOE_FIELDS:
        if key == "shared_expert_intermediate_size" and model_type == "qwen2_moe":
            continue
        if cfg.get(key):
            raise ValueError(f"{model_type}: {key}={cfg[key]!r} is not supported (no grouped routing, and "
                             f"no shared experts but Qwen2-MoE's one, in the engine's mixture of experts)")
    # Mixtral names it num_local_experts, Qwen3-MoE / OLMoE num_experts (transformers 5 may write either)
    default = {"mixtral": 8, "qwen3_moe": 128, "olmoe": 64, "qwen2_moe": 60}[model_type]
    experts = next((cfg[k] for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None), default)
    # Mixtral always renormalises the top k; the others as norm_topk_prob says (default False)
    norm_topk = True if model_type == "mixtral" else bool(cfg.get("norm_topk_prob", False))
    dense: list[int] = []
    fields: dict[str, Any] = {"num_experts": int(experts), "norm_topk_prob": norm_topk,
                              "num_experts_per_tok": int(cfg.get("num_experts_per_tok",
                                                                 {"mixtral": 2, "qwen3_moe": 8,
                                                                  "qwen2_moe": 4}.get(model_type, 8)))}
    if model_type in ("qwen3_moe", "qwen2_moe"):
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"{model_type}: decoder_sparse_step={step} must be >= 1")
        only = list(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(layers) if i in only or experts == 0 or (i + 1) % step]
        fields["moe_intermediate_size"] = int(cfg.get("moe_intermediate_size",
                                                      768 if model_type == "qwen3_moe" else 1408))
    if model_type == "qwen2_moe":
        shared = cfg.get("shared_expert_intermediate_size", 5632)
        fields["shared_expert_intermediate_size"] = int(shared) if shared else None
    if model_type == "olmoe":
        fields["qk_norm_per_head"] = False
        if cfg.get("clip_qkv") is not None:
            fields["clip_qkv"] = float(cfg["clip_qkv"])
        head_dim = cfg.get("head_dim")
        if head_dim and head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:
            raise ValueError(f"olmoe: head_dim={head_dim} is not supported (OLMoE's k_norm assumes "
                             f"hidden_size / num_attention_heads)")
    fields["dense_mlp_layers"] = dense
    if experts == 0:
        fields["num_experts_per_tok"] = 0
    return fields

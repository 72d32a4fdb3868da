"""ModelConfig: the shape of a Llama-family decoder, read from GGUF metadata or HF config.json."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_SCALING = (None, "default", "linear", "llama3")


@dataclass
class ModelConfig:
    architecture: str                 # "llama" | "qwen2" | "mistral" (all the same block here)
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

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model architecture {self.architecture!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        kind = rope_scaling_type(self.rope_scaling)
        if kind not in SUPPORTED_ROPE_SCALING:
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def projection_shapes(self) -> tuple[tuple[int, int], ...]:
        """`[out, in]` of every matmul of a forward pass, in order: each layer's fused q|k|v,
        attention output, fused gate|up and down projections, then the LM head."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return ((q + 2 * kv, h), (h, q), (2 * i, h), (h, i)) * self.num_layers + ((self.vocab_size, h),)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        return cls(**data)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        """From a Hugging Face config.json (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)."""
        model_type = cfg.get("model_type", "llama")
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [key for key in required if key not in cfg]
        if missing:
            raise ValueError(f"config.json is missing {', '.join(missing)}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        rope_scaling = cfg.get("rope_scaling")
        max_positions = cfg.get("max_position_embeddings", 2048)
        # Sliding-window attention is not implemented: cap the context at the window, where
        # full attention computes exactly the same thing.
        window = cfg.get("sliding_window")
        if window and (model_type == "mistral" or cfg.get("use_sliding_window")):
            max_positions = min(max_positions, window)
        rope_theta = cfg.get("rope_theta")
        # transformers 5 moved rope settings into `rope_parameters`
        rope_parameters = cfg.get("rope_parameters")
        if isinstance(rope_parameters, dict):
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
            if rope_parameters.get("rope_type", "default") != "default":
                rope_scaling = rope_parameters
        return cls(
            architecture=model_type,
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            name=name,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], has_output_weight: bool, name: str = "") -> "ModelConfig":
        """From GGUF key/values (llama.cpp names). `has_output_weight`: the file has an `output.weight`
        tensor; without one the lm_head is tied to the token embedding."""
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

        def key(suffix: str, default: Any = ...) -> Any:
            full = f"{arch}.{suffix}"
            if full in meta:
                return meta[full]
            if default is ...:
                raise ValueError(f"GGUF metadata is missing {full!r}")
            return default

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        vocab = key("vocab_size", None)
        if vocab is None:
            vocab = len(meta["tokenizer.ggml.tokens"])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", key("rope.dimension_count", hidden // heads))),
            intermediate_size=int(key("feed_forward_length")),
            vocab_size=int(vocab),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch == "qwen2",
            rope_scaling=_gguf_rope_scaling(meta, arch),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [int(eos)],
            name=name,
        )


def rope_scaling_type(rope_scaling: Optional[dict[str, Any]]) -> Optional[str]:
    if not rope_scaling:
        return None
    return rope_scaling.get("rope_type") or rope_scaling.get("type")


def _gguf_rope_scaling(meta: dict[str, Any], arch: str) -> Optional[dict[str, Any]]:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")

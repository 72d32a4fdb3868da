"""Random-weight Hugging Face folders of the engine's non-Llama families, at realistic small sizes,
for speed runs against transformers on the same weights (`python -m bench.engine --model FOLDER`).

    python -m bench.random_hf_models qwen3-small /tmp/qwen3-small

Each folder is written with transformers' own config and model classes (random init, seed 0) in
float32 safetensors, with the default model's tokenizer and chat template (so the standard
workload tokenizes the same as for the default model); the vocabulary is the tokenizer's. The
shapes follow each family's small released models, scaled to run on a 2-core CPU in minutes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nightshift.engine.tokenizer import load_tokenizer

VOCAB = 49152   # the default model's tokenizer

SHAPES: dict[str, tuple[str, str, dict]] = {   # name: (config class, model class, fields)
    # Qwen3-0.6B's layout (q/k norms, head_dim 128 > hidden / heads), fewer layers
    "qwen3-small": ("Qwen3Config", "Qwen3ForCausalLM", dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                  num_key_value_heads=8, head_dim=128, intermediate_size=3072)),
    # Gemma 3 1B's layout (sliding 512 on 5 of 6 layers, soft-capping off as in Gemma 3), fewer layers
    "gemma3-small": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(hidden_size=1152, num_hidden_layers=6, num_attention_heads=4,
                                        num_key_value_heads=1, head_dim=256, intermediate_size=6912,
                                        sliding_window=512, query_pre_attn_scalar=256)),
    # Gemma 2 2B's layout (soft-capping, alternating sliding 4096 / global), fewer layers
    "gemma2-small": ("Gemma2Config", "Gemma2ForCausalLM", dict(hidden_size=1152, num_hidden_layers=6, num_attention_heads=8,
                                    num_key_value_heads=4, head_dim=256, intermediate_size=4608,
                                    sliding_window=4096, query_pre_attn_scalar=256)),
    # Phi-4-mini's layout (partial rotary 0.75, fused projections), fewer layers and narrower
    "phi3-small": ("Phi3Config", "Phi3ForCausalLM", dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                num_key_value_heads=8, intermediate_size=4096, partial_rotary_factor=0.75)),
    # OLMoE's layout (64 experts, top-8), fewer layers and experts
    "olmoe-small": ("OlmoeConfig", "OlmoeForCausalLM", dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                  num_key_value_heads=16, intermediate_size=512, num_experts=16,
                                  num_experts_per_tok=4)),
    # Mixtral 8x7B's layout (8 experts, top-2, GQA 4:1, expert width 3.5x hidden), fewer layers and narrower
    "mixtral-small": ("MixtralConfig", "MixtralForCausalLM", dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                      num_key_value_heads=4, intermediate_size=3584, num_local_experts=8,
                                      num_experts_per_tok=2)),
    # Qwen3-30B-A3B's layout (q/k norms, head_dim 128, 128 narrow experts, top-8), fewer layers and experts
    "qwen3-moe-small": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                        num_key_value_heads=4, head_dim=128, intermediate_size=3072,
                                        moe_intermediate_size=384, num_experts=32, num_experts_per_tok=8,
                                        norm_topk_prob=True)),
    # Qwen1.5-MoE-A2.7B's layout (q/k/v biases, top-4 experts beside a gated shared expert 4x as wide), fewer layers and experts
    "qwen2-moe-small": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                        num_key_value_heads=16, intermediate_size=2816, moe_intermediate_size=704,
                                        shared_expert_intermediate_size=2816, num_experts=16, num_experts_per_tok=4)),
}


def write_random_folder(name: str, folder: Path, seed: int = 0) -> Path:
    """The random-weight folder of shape ``name`` (SHAPES) at ``folder``; reused when it exists."""
    import transformers

    if (folder / "config.json").exists():
        return folder
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    config_class, model_class, fields = SHAPES[name]
    tokenizer = load_tokenizer("default")
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    config = getattr(transformers, config_class)(vocab_size=VOCAB, max_position_embeddings=8192,
                                                       eos_token_id=eos, bos_token_id=None, pad_token_id=eos,
                                                       **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.backend.save(str(folder / "tokenizer.json"))          # as bench.dummy_weights.save_hf_folder
    tokens = {key: value for key, value in tokenizer.special_tokens.items() if value is not None}
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": tokenizer.chat_template, **tokens}))
    return folder


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_random_folder(args.shape, args.folder, args.seed))


if __name__ == "__main__":
    main()

"""Writing a transformers model to a GGUF file as llama.cpp's convert_hf_to_gguf.py lays it out
(the gguf package's GGUFWriter, llama.cpp's tensor names and keys, the default model's tokenizer
fields; F32 tensors, or Q4_0 projections as llama.cpp quantizes them; a mixture of experts' stacked
expert tensors), and our logits of a prompt
in two prefill chunks, for the GGUF tests of each architecture."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from nightshift.engine.model_files import resolve_model

GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
# transformers' stacked experts (`[experts, 2 * I, H]` gate|up, `[experts, H, I]` down) -> llama.cpp's
# ffn_{gate,up,down}_exps, split along the rows as its converter stacks the per-expert tensors
STACKED_EXPERTS = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
                   "mlp.experts.down_proj": ("ffn_down_exps",)}


def write_gguf(model, path, arch: str, layer_names: dict[str, str], describe: Callable, quantize: bool = False,
               norm_shift: float = 0.0, extra: dict[str, torch.Tensor] | None = None, permute_qk: bool = False) -> None:
    """`layer_names`: HF module name in a layer -> llama.cpp's; `describe(writer, config)` writes the
    architecture's keys; `norm_shift` is added to every *norm.weight (Gemma's +1); `extra`: more
    float32 tensors by GGUF name; `permute_qk`: q/k rows permuted as llama.cpp's LlamaModel does
    (architecture "llama"). A tied lm_head is left out, as llama.cpp does."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    describe(writer, model.config)
    reader = gguf.GGUFReader(resolve_model("default"))      # the default model's tokenizer
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    tied = model.config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        data = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            data = data + norm_shift
        if permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = model.config.num_attention_heads if "q_proj" in name else model.config.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(data.shape)
        if name in GLOBAL:
            gguf_name = GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            if rest in STACKED_EXPERTS:
                parts = STACKED_EXPERTS[rest]
                for part, rows in zip(parts, np.split(data, len(parts), axis=1)):
                    add(writer, f"blk.{layer}.{part}.weight", np.ascontiguousarray(rows), quantize)
                continue
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{layer_names[module]}.{suffix}"
        add(writer, gguf_name, data, quantize and data.ndim == 2 and name.endswith("proj.weight"))
    for gguf_name, tensor in (extra or {}).items():
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add(writer, gguf_name: str, data: np.ndarray, quantize: bool) -> None:
    """A float32 tensor, or its Q4_0 blocks as llama.cpp quantizes them (along the rows)."""
    import gguf
    if quantize:
        blocks = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0)
        writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    else:
        writer.add_tensor(gguf_name, data)


def describe_common(writer, config) -> None:
    """The keys every llama.cpp text model file has."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


@torch.inference_mode()
def ours_logits(model, ids: list[int]) -> torch.Tensor:
    """Our logits at the end of each of two prefill chunks (the first half, then the rest)."""
    from nightshift.engine.model_runner import ModelRunner, StepItem
    runner = ModelRunner(model, num_kv_blocks=8, block_size=16)
    table = list(range(8))
    return torch.cat([runner.execute([StepItem(ids[:n], 0, table)]) for n in (len(ids) // 2, len(ids))])


@torch.inference_mode()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits at the same two positions."""
    hf = model(torch.tensor([ids])).logits[0].float()
    return torch.stack([hf[len(ids) // 2 - 1], hf[-1]])

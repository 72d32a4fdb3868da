"""Shared checks of tests/engine/models/: a tiny random transformers model saved as a HF folder,
loaded by our loader (float32, CPU), against transformers float32 on the same weights.

* `check_steps`: one prompt prefilled in chunks through the ModelRunner (paged KV cache, both CPU
  attention backends), then 32 greedy decode steps: logits allclose to transformers' own
  incremental decoding (its KV cache) at every step, greedy tokens equal.
* `check_engine`: the Engine on a batch of mixed-length prompts sharing a system prefix, prefix
  cache on, chunked prefill (max_num_batched_tokens below the long prompts): greedy tokens equal
  to transformers' for every prompt, and the same again with the prefix cache off.
* `check_int4`: the same folder loaded with INT4 projections runs and gives finite logits.
"""
from __future__ import annotations

from pathlib import Path

import torch

from nightshift.engine.engine import Engine
from nightshift.engine.loader import load_model
from nightshift.engine.model_runner import ModelRunner, StepItem
from nightshift.engine.quant.config import resolve_quant_config
from nightshift.engine.quant.int4_linear import Int4Linear
from nightshift.engine.tokenizer import load_tokenizer
from nightshift.engine.types import GenerationRequest, SamplingParams

NEW_TOKENS = 32
ATOL = 1e-4
VOCAB = 49152          # the default tokenizer's (the Engine needs one; prompts are token ids)


def randomize_norms(model: torch.nn.Module, scale: float = 0.3) -> None:
    """Norm weights start at 1 (or 0 for Gemma's 1 + w): random ones test that each is applied where it should."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * scale)


def save(model: torch.nn.Module, folder: Path) -> str:
    model.eval().save_pretrained(folder)
    return str(folder)


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


@torch.inference_mode()
def hf_greedy(model, ids: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """transformers' greedy continuation with its KV cache: tokens, each step's logits
    `[new_tokens, V]`, and the prefill logits of every prompt position `[len(ids), V]`."""
    out = model(torch.tensor([ids]), use_cache=True)
    prefill = out.logits[0].float()
    tokens, logits = [], []
    for _ in range(new_tokens):
        step = out.logits[0, -1].float()
        tokens.append(int(step.argmax()))
        logits.append(step)
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits), prefill


@torch.inference_mode()
def check_steps(ours, reference, ids: list[int], chunk: int, **attention_options) -> None:
    tokens, hf_logits, hf_prefill = hf_greedy(reference, ids)
    block = 8
    total = len(ids) + NEW_TOKENS
    blocks = -(-total // block)
    table = list(range(blocks))[::-1]             # blocks out of order: paging must not matter
    runner = ModelRunner(ours, num_kv_blocks=blocks + 2, block_size=block, **attention_options)
    # chunked prefill: each chunk's last-row logits against transformers' prefill logits there
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        got = runner.execute([StepItem(piece, start, table)])[0]
        pos = start + len(piece) - 1
        diff = (got - hf_prefill[pos]).abs().max().item()
        assert diff < ATOL, f"prefill chunk ending at {pos}: max abs logit difference {diff:.2e}"
    ours_tokens = []
    step_logits = got
    for step in range(NEW_TOKENS):
        diff = (step_logits - hf_logits[step]).abs().max().item()
        assert diff < ATOL, f"decode step {step}: max abs logit difference {diff:.2e}"
        ours_tokens.append(int(step_logits.argmax()))
        assert ours_tokens == tokens[:step + 1], f"greedy token {step} differs"
        if step + 1 < NEW_TOKENS:
            step_logits = runner.execute([StepItem([ours_tokens[-1]], len(ids) + step, table)])[0]
    assert ours_tokens == tokens


def engine_prompts(system_len: int = 40, lengths: tuple[int, ...] = (3, 9, 17, 26, 35, 50, 61, 5)) -> list[list[int]]:
    """Mixed lengths, the first six sharing a system prefix (prefix cache hits), several longer
    than the engine's token budget (chunked prefill)."""
    system = prompt(system_len, 1000)
    return [system + prompt(n, i) for i, n in enumerate(lengths[:6])] + [prompt(n, 100 + n) for n in lengths[6:]]


def check_engine(ours, reference, max_batched_tokens: int = 32, prompts: list[list[int]] | None = None) -> None:
    prompts = prompts or engine_prompts()
    expected = [hf_greedy(reference, p)[0] for p in prompts]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    tokenizer = load_tokenizer("default")
    for prefix_cache in (True, False):
        engine = Engine.from_model(ours, tokenizer, "tiny", max_num_batched_tokens=max_batched_tokens,
                                   num_kv_blocks=256, max_num_seqs=8, enable_prefix_caching=prefix_cache)
        requests = [GenerationRequest(f"p{i}", p, params) for i, p in enumerate(prompts)]
        outputs = {o.request_id: o for o in engine.generate(requests)}
        stats = engine.stats()
        if prefix_cache:
            assert sum(o.cached_prompt_tokens > 0 for o in outputs.values()) >= 3, "no prefix cache hits"
        assert stats.num_steps < len(prompts) * NEW_TOKENS / 2, "not batched"
        for i, ref in enumerate(expected):
            assert outputs[f"p{i}"].token_ids == ref, f"prompt {i} (prefix cache {prefix_cache}) differs from HF"


@torch.inference_mode()
def check_int4(folder: str, cache_dir: Path, ids: list[int]) -> None:
    model = load_model(folder, quant_config=resolve_quant_config("int4"), cache_dir=str(cache_dir), cpu_math="float32")
    assert any(isinstance(m, Int4Linear) for m in model.modules()), "no INT4 projection"
    runner = ModelRunner(model, num_kv_blocks=16, block_size=16)
    table = list(range(16))
    logits = runner.execute([StepItem(ids, 0, table)])
    logits = torch.cat([logits, runner.execute([StepItem([int(logits[0].argmax())], len(ids), table)])])
    assert logits.shape == (2, model.config.vocab_size) and torch.isfinite(logits).all()

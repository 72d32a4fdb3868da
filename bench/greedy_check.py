"""`python -m bench.greedy_check`: our engine's greedy tokens vs HF transformers on one device.

The rule (the same for every device and dtype; only the near-tie margin depends on the dtype):
* Reference: transformers' LlamaForCausalLM on the same weights, device and dtype, greedy, one
  prompt at a time, recording each step's logits.
* Ours: every prompt in ONE Engine.generate call (continuous batching, chunked prefill with a
  small token budget, prefix cache on), greedy, EOS ignored.
* A prompt is *equal* when all `new_tokens` tokens match. Otherwise it *diverges after a near-tie*
  when some position at or before its first mismatch had the reference's top-2 logits within
  `near_tie` (default 1e-3 for float32, 0.125 for bfloat16/float16: one bf16 step at logits of
  16-32, below which rounding of either side can swap the two).
* Pass: at least `min_equal` (0.9) of prompts equal and every other one diverging after a near-tie.

The prompt set: 8 chat questions with a shared system prompt (so the prefix cache and cascade
attention are exercised), 4 without it, and 6 raw texts of mixed lengths (chunked prefill);
tests/engine/test_correctness.py uses the same set.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

import torch

SYSTEM = ("You are Nightshift's assistant. You answer briefly and precisely, you never invent facts, "
          "and when a question is ambiguous you say which reading you chose before answering it.")
QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish and German.",
    "Give me three tips for learning to play the guitar.",
    "What is 17 multiplied by 23?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]
RAW_TEXTS = [
    "Once upon a time",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colours are",
    "import torch\nimport torch.nn as nn\n\nclass MLP(nn.Module):",
    "Q: What is the boiling point of water at sea level?\nA:",
    ("The history of the bicycle begins in the early nineteenth century, when inventors in Europe "
     "experimented with two-wheeled machines pushed along by the rider's feet. ") * 4,
]
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.125, torch.float16: 0.125}


def default_prompts(tokenizer) -> list[list[int]]:
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": q}]) for q in QUESTIONS]
    prompts += [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS[:4]]
    prompts += [tokenizer.encode(t) for t in RAW_TEXTS]
    return prompts


@dataclass
class PromptResult:
    index: int
    first_mismatch: Optional[int]      # None: equal in full
    first_near_tie: Optional[int]      # first reference position with top-2 gap < near_tie

    @property
    def equal(self) -> bool:
        return self.first_mismatch is None

    @property
    def ok(self) -> bool:
        return self.equal or (self.first_near_tie is not None and self.first_near_tie <= self.first_mismatch)


def compare(index: int, ours: list[int], reference: list[int], reference_logits: torch.Tensor,
            near_tie: float) -> PromptResult:
    """reference_logits `[len(reference), vocab]`: the reference's logits at each generated position."""
    if len(ours) != len(reference):
        raise ValueError(f"prompt {index}: {len(ours)} tokens from the engine, {len(reference)} from the reference")
    mismatch = next((j for j, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
    top2 = reference_logits.float().topk(2, dim=-1).values
    ties = ((top2[:, 0] - top2[:, 1]) < near_tie).nonzero().flatten().tolist()
    return PromptResult(index, mismatch, ties[0] if ties else None)


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of one prompt and the logits of each step."""
    device = next(hf.parameters()).device
    out = hf(torch.tensor([prompt], device=device), use_cache=True)
    tokens, logits = [], []
    for _ in range(new_tokens):
        step = out.logits[0, -1].float()
        token = int(step.argmax())
        tokens.append(token)
        logits.append(step.cpu())
        out = hf(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return tokens, torch.stack(logits)


def check(engine, hf, prompts: list[list[int]], new_tokens: int, near_tie: float) -> list[PromptResult]:
    from nightshift.engine.types import GenerationRequest, SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outputs = {o.request_id: o for o in engine.generate([GenerationRequest(f"p{i}", p, params)
                                                          for i, p in enumerate(prompts)])}
    failed = [o for o in outputs.values() if o.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"engine rejected {failed[0].request_id}: {failed[0].error}")
    results = []
    for i, prompt in enumerate(prompts):
        reference, logits = hf_greedy(hf, prompt, new_tokens)
        results.append(compare(i, outputs[f"p{i}"].token_ids, reference, logits, near_tie))
    return results


def passes(results: list[PromptResult], min_equal: float) -> bool:
    equal = sum(r.equal for r in results)
    return equal >= min_equal * len(results) and all(r.ok for r in results)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.greedy_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the engine's)")
    parser.add_argument("--quantization", choices=("none", "int4"), default="none")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--near-tie", type=float, default=None, help="default: by dtype (see above)")
    parser.add_argument("--min-equal", type=float, default=0.9)
    parser.add_argument("--max-num-batched-tokens", type=int, default=48, help="small: long prompts are chunked")
    args = parser.parse_args(argv)

    from bench.engine import hf_model_from_cache
    from nightshift.engine.engine import Engine
    from nightshift.engine.engine_config import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    near_tie = args.near_tie if args.near_tie is not None else NEAR_TIE[dtype]
    engine = Engine.from_pretrained(args.model, quantization=args.quantization, device=device, dtype=dtype,
                                    max_num_seqs=32, max_num_batched_tokens=args.max_num_batched_tokens,
                                    num_kv_blocks=512)
    hf = hf_model_from_cache(args.model, dtype).to(device)
    results = check(engine, hf, default_prompts(engine.tokenizer), args.new_tokens, near_tie)
    for r in results:
        state = "equal" if r.equal else (f"differs at {r.first_mismatch}, near-tie at {r.first_near_tie}"
                                         if r.ok else f"DIFFERS at {r.first_mismatch} before any near-tie")
        print(f"prompt {r.index:2d}: {state}")
    equal = sum(r.equal for r in results)
    ok = passes(results, args.min_equal)
    print(f"{equal}/{len(results)} equal in full for {args.new_tokens} tokens on {device} {dtype}, near-tie "
          f"< {near_tie}: {'PASS' if ok else 'FAIL'}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

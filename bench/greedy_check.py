"""`python -m bench.greedy_check`: our engine's greedy tokens vs HF transformers on one device.

float32 (the same for every device; the engine must equal HF; on CPU only with the float32 CPU math,
``NIGHTSHIFT_CPU_MATH=float32``: a float32 CPU model may multiply in bf16 or int8, and is then held
to the 16-bit rule below):
* Reference: transformers' LlamaForCausalLM on the same weights, device and dtype, greedy, one
  prompt at a time, recording each step's logits.
* Ours: every prompt in ONE Engine.generate call (continuous batching, chunked prefill with a
  small token budget, prefix cache on), greedy, EOS ignored.
* A prompt is *equal* when all `new_tokens` tokens match. Otherwise it *diverges after a near-tie*
  when some position at or before its first mismatch had the reference's top-2 logits within
  `near_tie` (default 1e-3: float32 rounding of either side can swap two logits that close).
* Pass: at least `min_equal` (0.9) of prompts equal and every other one diverging after a near-tie.

bfloat16 / float16 (and INT4, whose activations are 16-bit): two 16-bit computations drift from the
exact result in different places, so comparing ours with HF's own 16-bit tokens says little (a
0.125 near-tie margin let through anything and flagged noise as a bug). Both are held against the
float32 reference instead (HF transformers in float32, same device; ``check_drift``):
* per prompt, where our tokens first differ from float32's, where HF's 16-bit tokens do, and our
  token's rank in float32's logits at our first difference (the prefix before it is the same, so
  those logits are the exact next-token distribution for it);
* a prompt is *ok* when ours equals float32 in full, or differs no earlier than HF's 16-bit model
  does, or our token there is among float32's top 5 (a plausible continuation, not garbage);
* Pass: every prompt ok, and ours drifts from float32 no earlier than HF's 16-bit model over the
  whole set, within noise: the tokens agreeing with float32 before the first difference, summed
  over prompts, at least 90% of HF's (``DRIFT_MARGIN``; two equally exact roundings move that sum
  by a few percent: on a Zen 5 CPU, our bfloat16 348/576 against HF bfloat16's 351/576, every
  first difference of ours float32's second choice).

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
TOP_K = 5                 # a 16-bit run's first difference from float32 must be one of its top 5
DRIFT_MARGIN = 0.9        # ... and its tokens agreeing with float32, summed, at least 90% of HF 16-bit's


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


def engine_greedy(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Our greedy continuations of every prompt, all in one Engine.generate call."""
    from nightshift.engine.types import GenerationRequest, SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outputs = {o.request_id: o for o in engine.generate([GenerationRequest(f"p{i}", p, params)
                                                          for i, p in enumerate(prompts)])}
    failed = [o for o in outputs.values() if o.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"engine rejected {failed[0].request_id}: {failed[0].error}")
    return [outputs[f"p{i}"].token_ids for i in range(len(prompts))]


def check(engine, hf, prompts: list[list[int]], new_tokens: int, near_tie: float) -> list[PromptResult]:
    ours = engine_greedy(engine, prompts, new_tokens)
    results = []
    for i, prompt in enumerate(prompts):
        reference, logits = hf_greedy(hf, prompt, new_tokens)
        results.append(compare(i, ours[i], reference, logits, near_tie))
    return results


@dataclass
class DriftResult:
    """One prompt of a 16-bit run against the float32 reference: where our tokens and HF's 16-bit
    tokens first differ from it (None: equal in full), and our token's rank (0 = the argmax) in the
    reference's logits at our first difference."""
    index: int
    ours: Optional[int]
    hf: Optional[int]
    rank: Optional[int]

    @property
    def ok(self) -> bool:
        return (self.ours is None or (self.hf is not None and self.ours >= self.hf)
                or (self.rank is not None and self.rank < TOP_K))


def first_difference(tokens: list[int], reference: list[int]) -> Optional[int]:
    if len(tokens) != len(reference):
        raise ValueError(f"{len(tokens)} tokens against a reference of {len(reference)}")
    return next((j for j, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)


def drift(index: int, ours: list[int], hf16: list[int], reference: list[int],
          reference_logits: torch.Tensor) -> DriftResult:
    """reference_logits `[len(reference), vocab]`: the float32 reference's logits at each position."""
    j = first_difference(ours, reference)
    rank = None
    if j is not None:
        row = reference_logits[j].float()
        rank = int((row > row[ours[j]]).sum())
    return DriftResult(index, j, first_difference(hf16, reference), rank)


def agreeing_tokens(first: Optional[int], new_tokens: int) -> int:
    """Tokens equal to the reference before the first difference."""
    return new_tokens if first is None else first


def drift_passes(results: list[DriftResult], new_tokens: int) -> bool:
    ours = sum(agreeing_tokens(r.ours, new_tokens) for r in results)
    hf = sum(agreeing_tokens(r.hf, new_tokens) for r in results)
    return ours >= DRIFT_MARGIN * hf and all(r.ok for r in results)


def check_drift(engine, hf32, hf16, prompts: list[list[int]], new_tokens: int) -> list[DriftResult]:
    """Our 16-bit engine and HF's 16-bit model, each against HF float32 (the module docstring)."""
    ours = engine_greedy(engine, prompts, new_tokens)
    results = []
    for i, prompt in enumerate(prompts):
        reference, logits = hf_greedy(hf32, prompt, new_tokens)
        theirs, _ = hf_greedy(hf16, prompt, new_tokens)
        results.append(drift(i, ours[i], theirs, reference, logits))
    return results


def passes(results: list[PromptResult], min_equal: float) -> bool:
    equal = sum(r.equal for r in results)
    return equal >= min_equal * len(results) and all(r.ok for r in results)


def exact_float32(engine, quantization: str) -> bool:
    """Whether the engine computes in float32 throughout (the float32 rule applies): a float32 model
    without INT4 and, on CPU, on the float32 CPU math (a float32 CPU model may multiply in bf16 or
    int8: engine/layers/cpu_math.py; NIGHTSHIFT_CPU_MATH=float32 forces float32)."""
    model = engine.runner.model
    math = getattr(model, "cpu_math", None)
    return model.dtype == torch.float32 and quantization == "none" and (math is None or math.math == "float32")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.greedy_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the engine's)")
    parser.add_argument("--quantization", choices=("none", "int4"), default="none")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--near-tie", type=float, default=None, help="float32: default 1e-3 (see above)")
    parser.add_argument("--min-equal", type=float, default=0.9, help="float32: the share of prompts equal in full")
    parser.add_argument("--max-num-batched-tokens", type=int, default=48, help="small: long prompts are chunked")
    args = parser.parse_args(argv)

    from bench.engine import hf_model_from_cache
    from nightshift.engine.engine import Engine
    from nightshift.engine.engine_config import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    engine = Engine.from_pretrained(args.model, quantization=args.quantization, device=device, dtype=dtype,
                                    max_num_seqs=32, max_num_batched_tokens=args.max_num_batched_tokens,
                                    num_kv_blocks=512)
    prompts = default_prompts(engine.tokenizer)
    what = engine.compute + (", INT4" if args.quantization == "int4" else "")
    if exact_float32(engine, args.quantization):
        near_tie = args.near_tie if args.near_tie is not None else NEAR_TIE[dtype]
        hf = hf_model_from_cache(args.model, dtype).to(device)
        results = check(engine, hf, prompts, args.new_tokens, near_tie)
        for r in results:
            state = "equal" if r.equal else (f"differs at {r.first_mismatch}, near-tie at {r.first_near_tie}"
                                             if r.ok else f"DIFFERS at {r.first_mismatch} before any near-tie")
            print(f"prompt {r.index:2d}: {state}")
        equal = sum(r.equal for r in results)
        ok = passes(results, args.min_equal)
        print(f"{equal}/{len(results)} equal in full for {args.new_tokens} tokens on {what}, near-tie "
              f"< {near_tie}: {'PASS' if ok else 'FAIL'}")
    else:
        hf32 = hf_model_from_cache(args.model, torch.float32).to(device)
        hf16 = hf_model_from_cache(args.model, dtype if dtype != torch.float32 else torch.bfloat16).to(device)
        hf16_name = str(next(hf16.parameters()).dtype).removeprefix("torch.")
        results = check_drift(engine, hf32, hf16, prompts, args.new_tokens)
        for r in results:
            theirs = f"HF {hf16_name}: " + ("equal" if r.hf is None else f"at {r.hf}")
            state = (f"equal to float32 ({theirs})" if r.ours is None else
                     f"differs from float32 at {r.ours} ({theirs}), our token float32's #{r.rank + 1} there"
                     + ("" if r.ok else ": NOT OK"))
            print(f"prompt {r.index:2d}: {state}")
        total = args.new_tokens * len(results)
        ours = sum(agreeing_tokens(r.ours, args.new_tokens) for r in results)
        theirs = sum(agreeing_tokens(r.hf, args.new_tokens) for r in results)
        ok = drift_passes(results, args.new_tokens)
        print(f"tokens equal to HF float32 before the first difference, {len(results)} prompts x "
              f"{args.new_tokens}: ours ({what}) {ours}/{total}, HF {hf16_name} {theirs}/{total}; equal in full: "
              f"ours {sum(r.ours is None for r in results)}, HF {sum(r.hf is None for r in results)}; "
              f"at least {DRIFT_MARGIN:.0%} of HF's: {'yes' if ours >= DRIFT_MARGIN * theirs else 'no'}; "
              f"every first difference no earlier than HF's or in float32's top {TOP_K}: "
              f"{'yes' if all(r.ok for r in results) else 'no'}: {'PASS' if ok else 'FAIL'}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

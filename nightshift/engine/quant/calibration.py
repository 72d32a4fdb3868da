"""Calibration activations for the activation-aware quantizers (AWQ scaling, GPTQ).

The full-precision model reads ``CALIBRATION_TEXTS`` as chat turns and continues each greedily
for ``CONTINUATION_TOKENS`` tokens (its own answers: the distribution a chat model is then used
on, none of them from bench/quality.py's evaluation prompts); the prompts plus continuations
are then run once more while every dense linear (not the lm_head) records its inputs
(engine/quant/activation_stats.py).

The loader builds the full-precision model and the tokenizer and calls ``calibration_stats``
(engine/loader.py), only when a layer misses the quantized-weight cache.
"""
from __future__ import annotations

import math

import torch

from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.quant.activation_stats import ActivationStats, collect_activation_stats
from nightshift.engine.step import StepItem

CALIBRATION_TEXTS = (
    "The history of science is full of surprising discoveries, accidents and long arguments.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Dear customer, thank you for your order. Your package will arrive next week by courier.",
    "In 1492 Columbus sailed across the Atlantic Ocean and reached the islands of the Caribbean.",
    "To bake bread, mix flour, water, salt and yeast, knead the dough and let it rise for hours.",
    "The stock market fell sharply on Monday as investors worried about rising interest rates.",
    "How do I reverse a linked list in Java? Please show the code.",
    "Describe the water cycle and why it matters for farmers.",
    "What should I pack for a week-long hiking trip in the mountains?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "Why is the sky blue during the day and red at sunset?",
    "List five tips for writing a clear and persuasive essay.",
    "What is the difference between a virus and a bacterium?",
    "Solve for x: 3x + 7 = 22, and explain each step.",
    "Tell me a short story about a robot who wants to become a gardener.",
    "What are the main causes of inflation, in simple terms?",
)
CONTINUATION_TOKENS = 96


def calibration_sequences(fp_model, tokenizer, continuation_tokens: int = CONTINUATION_TOKENS) -> list[list[int]]:
    """Each calibration text as a chat turn followed by the model's greedy answer."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in CALIBRATION_TEXTS]
    runner, tables = _runner_for(fp_model, [len(p) + continuation_tokens for p in prompts])
    sequences = [list(p) for p in prompts]
    items = [StepItem(p, 0, t) for p, t in zip(prompts, tables)]
    with torch.no_grad():
        for _ in range(continuation_tokens):
            chosen = runner.execute(items).argmax(-1).tolist()
            for seq, tok in zip(sequences, chosen):
                seq.append(tok)
            items = [StepItem([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables)]
    return sequences


def calibration_stats(fp_model, tokenizer) -> dict[str, ActivationStats]:
    """Activation statistics of ``fp_model`` (dense layers) over the calibration sequences."""
    sequences = calibration_sequences(fp_model, tokenizer)
    runner, tables = _runner_for(fp_model, [len(s) for s in sequences])
    items = [StepItem(s, 0, t) for s, t in zip(sequences, tables)]
    with torch.no_grad():
        return collect_activation_stats(fp_model, lambda: runner.execute(items))


def _runner_for(fp_model, lengths: list[int], block_size: int = 16):
    """A ModelRunner with room for sequences of `lengths` tokens, and each one's block table."""
    blocks = [math.ceil(n / block_size) for n in lengths]
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    runner = ModelRunner(fp_model, num_kv_blocks=sum(blocks), block_size=block_size)
    return runner, [list(range(s, s + n)) for s, n in zip(starts, blocks)]

"""ModelRunner vs HF transformers on the real default model, float32, same GGUF weights.

Several prompts run through a schedule that mixes chunked prefill (chunks of different sizes,
with earlier tokens already in the paged cache), whole-prompt prefill and batched decode steps,
on scattered block tables. Every logits row we return must match transformers' logits for the
same position: max abs diff < 1e-3.
"""
from __future__ import annotations

import random

import pytest
import torch

from nightshift.engine.attention import CpuKernelAttention, TorchAttention
from nightshift.engine.model_runner import ModelRunner, StepItem

pytestmark = pytest.mark.slow
BLOCK_SIZE = 16
TOLERANCE = 1e-3

TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea. The waves roll in, and the gulls cry over the harbour at dusk",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Q: What is 17 times 23?\nA:",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about "
    "mathematics, astronomy and the history of ancient kingdoms. Every morning the dragon",
]
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def sequences(hf_tokenizer):
    """Each sequence: its prompt ids plus DECODE_STEPS continuation ids (any ids will do: we compare logits)."""
    rng = random.Random(0)
    return [hf_tokenizer.encode(t) + [rng.randrange(hf_tokenizer.vocab_size) for _ in range(DECODE_STEPS)]
            for t in TEXTS]


@pytest.fixture(scope="module")
def reference_logits(hf_reference_model, sequences):
    with torch.inference_mode():
        return [hf_reference_model(torch.tensor([s])).logits[0].float() for s in sequences]


def scattered_block_tables(sequences, num_blocks, seed=1):
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = []
    for s in sequences:
        n = (len(s) + BLOCK_SIZE - 1) // BLOCK_SIZE
        tables.append(ids[:n])
        ids = ids[n:]
    return tables


def run_schedule(runner, sequences, tables, chunk_sizes):
    """Prefill every prompt in chunks (sequence i uses chunk_sizes[i], several sequences per step),
    then decode all together; returns {(seq, position): logits row}."""
    prompt_lens = [len(s) - DECODE_STEPS for s in sequences]
    done = [0] * len(sequences)
    results = {}
    while any(done[i] < prompt_lens[i] for i in range(len(sequences))):
        items, keys = [], []
        for i, seq in enumerate(sequences):
            if done[i] >= prompt_lens[i]:
                continue
            n = min(chunk_sizes[i], prompt_lens[i] - done[i])
            last = done[i] + n == prompt_lens[i]
            need = last or i % 2 == 0   # also ask for logits of some intermediate chunks
            items.append(StepItem(seq[done[i]:done[i] + n], done[i], tables[i], need))
            if need:
                keys.append((i, done[i] + n - 1))
            done[i] += n
        for key, row in zip(keys, runner.execute(items)):
            results[key] = row
    for step in range(DECODE_STEPS):
        items, keys = [], []
        for i, seq in enumerate(sequences):
            pos = prompt_lens[i] + step
            items.append(StepItem([seq[pos]], pos, tables[i], True))
            keys.append((i, pos))
        logits = runner.execute(items)
        assert logits.shape == (len(sequences), runner.config.vocab_size)
        for key, row in zip(keys, logits):
            results[key] = row
    return results


def kernel_runner(cpu_kernel: bool, *args, **kwargs) -> ModelRunner:
    """A runner with the CPU paged-attention kernel (engine/kernels/cpu_paged_attention.py) on or off."""
    runner = ModelRunner(*args, cpu_kernel=cpu_kernel, **kwargs)
    if cpu_kernel and not isinstance(runner.attention, CpuKernelAttention):
        pytest.skip("the CPU attention kernel does not build here")
    assert cpu_kernel or isinstance(runner.attention, TorchAttention)
    return runner


@pytest.mark.parametrize("cpu_kernel", [False, True])
@pytest.mark.parametrize("chunk_sizes, decode_bucket", [
    ([5, 7, 64, 3, 11], 1),        # exact-length decode groups
    ([1, 16, 9, 32, 13], 64),      # masked (padded) decode groups; 1-token chunks
    ([64, 64, 64, 64, 64], 64),    # whole prompts in one step
])
def test_logits_match_transformers(fp32_model, sequences, reference_logits, chunk_sizes, decode_bucket, cpu_kernel):
    runner = kernel_runner(cpu_kernel, fp32_model, num_kv_blocks=64, block_size=BLOCK_SIZE, decode_bucket=decode_bucket)
    tables = scattered_block_tables(sequences, 64)
    results = run_schedule(runner, sequences, tables, chunk_sizes)
    assert len(results) >= len(sequences) * (DECODE_STEPS + 1)
    worst = max((row - reference_logits[i][pos]).abs().max().item() for (i, pos), row in results.items())
    assert worst < TOLERANCE, f"max abs logit difference {worst:.2e}"
    for (i, pos), row in results.items():
        assert row.argmax().item() == reference_logits[i][pos].argmax().item()


def test_logits_in_item_order_and_only_where_asked(fp32_model, sequences, reference_logits):
    """Decode and prefill items interleaved, some without logits: rows come back in item order."""
    runner = ModelRunner(fp32_model, num_kv_blocks=64, block_size=BLOCK_SIZE)
    tables = scattered_block_tables(sequences, 64)
    a, b, c = sequences[0], sequences[1], sequences[3]
    runner.execute([StepItem(a[:-1], 0, tables[0], False), StepItem(b[:10], 0, tables[1], False)])
    logits = runner.execute([
        StepItem(c[:4], 0, tables[3], True),                    # fresh prefill
        StepItem([a[-1]], len(a) - 1, tables[0], True),          # decode
        StepItem(b[10:12], 10, tables[1], False),                # chunk over a cached prefix, no logits
        StepItem(sequences[2][:5], 0, tables[2], True),          # another fresh prefill
    ])
    expected = [reference_logits[3][3], reference_logits[0][len(a) - 1], reference_logits[2][4]]
    assert logits.shape[0] == 3
    for row, ref in zip(logits, expected):
        assert (row - ref).abs().max().item() < TOLERANCE
    # the no-logits chunk was still written to the cache: continuing b from it matches
    row = runner.execute([StepItem(b[12:14], 12, tables[1], True)])[0]
    assert (row - reference_logits[1][13]).abs().max().item() < TOLERANCE


def test_bf16_runs_and_agrees_roughly(default_model_path, sequences, reference_logits):
    from nightshift.engine.loader import load_model
    model = load_model(default_model_path, dtype=torch.bfloat16)
    runner = ModelRunner(model, num_kv_blocks=64, block_size=BLOCK_SIZE)
    tables = scattered_block_tables(sequences, 64)
    results = run_schedule(runner, sequences, tables, [7, 64, 5, 64, 20])
    agree = sum(row.argmax().item() == reference_logits[i][pos].argmax().item() for (i, pos), row in results.items())
    assert results[(0, len(sequences[0]) - 1)].dtype == torch.float32
    assert agree >= 0.9 * len(results)


def test_rejects_bad_items(fp32_model):
    runner = ModelRunner(fp32_model, num_kv_blocks=4, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="StepItem 1: 20 tokens need 2 blocks"):
        runner.execute([StepItem([1, 2], 0, [0], True), StepItem(list(range(20)), 0, [1], True)])
    with pytest.raises(ValueError, match="outside the pool"):
        runner.execute([StepItem([1, 2], 0, [7], True)])
    with pytest.raises(ValueError, match="no new tokens"):
        runner.execute([StepItem([], 0, [0], True)])
    with pytest.raises(ValueError, match="vocabulary"):
        runner.execute([StepItem([10 ** 6], 0, [0], True)])


def test_kv_bytes_per_block(fp32_model):
    runner = ModelRunner(fp32_model, num_kv_blocks=2, block_size=BLOCK_SIZE)
    cfg = fp32_model.config
    assert runner.kv_bytes_per_block == 2 * cfg.num_layers * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * 4
    assert sum(k.numel() + v.numel() for k, v in runner.kv_caches) * 4 == 2 * runner.kv_bytes_per_block


@pytest.fixture(scope="module")
def shared_prefix_sequences(hf_tokenizer):
    """A 40+-token shared system prompt, then different user turns, then continuation ids."""
    system = hf_tokenizer.encode("You are a careful assistant. Answer briefly, cite sources when you can, "
                                 "and never invent facts. Today we talk about geography and history: rivers, "
                                 "mountains, old empires, trade routes and the cities that grew along them.")
    rng = random.Random(2)
    turns = ["Where is Lima?", "Who built the pyramids of Giza and when were they finished?", "Capital of Mongolia",
             "Tell me about the Hanseatic League, its cities and its trade routes across the Baltic."]
    return [system + hf_tokenizer.encode(t) + [rng.randrange(1000, 40000) for _ in range(DECODE_STEPS)]
            for t in turns], len(system)


@pytest.mark.parametrize("leaders, shared_prefix_attention, cpu_kernel", [
    ((0,), True, False),        # one family: all four share the prefix blocks
    ((0,), False, False),       # same, plain attention
    ((0, 2), True, False),      # two families, each with its own copy of the prefix
    ((0, 2, 3), True, False),   # one family plus two sequences with their own blocks
    ((0, 2, 3), True, True),    # the CPU kernel reads shared blocks in place
])
def test_shared_prefix_blocks_match_transformers(fp32_model, hf_reference_model, shared_prefix_sequences,
                                                 leaders, shared_prefix_attention, cpu_kernel):
    """Leaders prefill their whole prompt; every other sequence reuses the full prefix blocks of the
    leader before it (as the prefix cache does) and prefills only the rest; then all decode together.
    The cascade path (prefix read once per family) and the plain path both match transformers."""
    sequences, system_len = shared_prefix_sequences
    with torch.inference_mode():
        reference = [hf_reference_model(torch.tensor([s])).logits[0] for s in sequences]
    runner = kernel_runner(cpu_kernel, fp32_model, num_kv_blocks=64, block_size=BLOCK_SIZE, decode_bucket=8,
                           shared_prefix_attention=shared_prefix_attention)
    shared_blocks = system_len // BLOCK_SIZE
    assert shared_blocks >= 2
    fresh = iter(range(64))
    tables, owners = [], []
    for i in range(len(sequences)):
        owner = max(leader for leader in leaders if leader <= i)
        prefix = [next(fresh) for _ in range(shared_blocks)] if owner == i else tables[owner][:shared_blocks]
        tables.append(prefix + [next(fresh) for _ in range(8)])
        owners.append(owner)
    prompt_lens = [len(s) - DECODE_STEPS for s in sequences]
    cached = shared_blocks * BLOCK_SIZE
    runner.execute([StepItem(sequences[i][:prompt_lens[i]], 0, tables[i], False) for i in leaders])
    followers = [i for i in range(len(sequences)) if i not in leaders]
    rows = runner.execute([StepItem(sequences[i][cached:prompt_lens[i]], cached, tables[i], True) for i in followers])
    worst = max((row - reference[i][prompt_lens[i] - 1]).abs().max().item() for row, i in zip(rows, followers))
    for step in range(DECODE_STEPS):
        items = [StepItem([s[n + step]], n + step, t, True) for s, n, t in zip(sequences, prompt_lens, tables)]
        for row, ref, n in zip(runner.execute(items), reference, prompt_lens):
            worst = max(worst, (row - ref[n + step]).abs().max().item())
    assert worst < TOLERANCE, f"max abs logit difference {worst:.2e}"
    items = [StepItem([1], n, t) for n, t in zip(prompt_lens, tables)]
    if cpu_kernel:   # one kernel call takes every row and reads shared blocks in place: no families
        meta = runner.attention.build_metadata(items)
        assert meta.rows.num_rows == len(sequences) and meta.item_order == list(range(len(sequences)))
        return
    families = runner.attention.decode_families(items)
    assert sorted(i for f in families for i in f) == list(range(len(sequences)))
    with_prefix = [f for f in families if runner.attention.shared_prefix_blocks([items[i] for i in f])]
    expected = {owner for owner in owners if owners.count(owner) > 1} if shared_prefix_attention else set()
    assert len(with_prefix) == len(expected)


def test_attention_with_lse_math_matches_cpu_kernel():
    from nightshift.engine.attention.torch_paged import attention_with_lse, attention_with_lse_math
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16)
    mask = torch.zeros(2, 1, 1, 9)
    mask[1, ..., 6:] = float("-inf")
    out, lse = attention_with_lse(q, k, v, mask, 0.25)
    out_m, lse_m = attention_with_lse_math(q, k, v, mask, 0.25)
    assert torch.allclose(out, out_m, atol=1e-5) and torch.allclose(lse, lse_m, atol=1e-5)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    assert torch.allclose(out, reference, atol=1e-5)

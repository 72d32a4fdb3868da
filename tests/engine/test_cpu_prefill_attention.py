"""Prefill chunks attended as tiles of 16 rows (engine/kernels/cpu_prefill_attention.py) and the CPU
kernel backend's use of them (attention/cpu_kernel_backend.py): the paged kernel's bits on every row
(so against float64 attention with its bfloat16 roundings too), row by row independent of the chunk
around it, and the real default model's logits the same bits with every row through the paged kernel."""
from __future__ import annotations

import pytest
import torch

from nightshift.engine.attention import cpu_kernel_backend
from nightshift.engine.kernels import cpu_paged_attention, cpu_prefill_attention

from test_cpu_attention import check_against_reference

needs_kernel = pytest.mark.skipif(not cpu_prefill_attention.supports(9, 3, 64, torch.bfloat16, 16),
                                  reason="no AVX-512 BF16 on this CPU: the paged kernel attends prefill rows")
needs_f32_kernel = pytest.mark.skipif(not cpu_prefill_attention.supports(9, 3, 64, torch.float32, 16),
                                      reason="no AVX-512 on this CPU: the paged kernel attends prefill rows")
POOLS = [pytest.param(torch.bfloat16, marks=needs_kernel, id="bf16"),
         pytest.param(torch.float32, marks=needs_f32_kernel, id="f32")]


def chunk_pool(heads: int, kv_heads: int, dim: int, block_size: int, chunks: list[tuple[int, int]], seed: int = 0):
    """A bfloat16 pool with one sequence per chunk (start, rows): its blocks scattered, its rows
    attending start + 1 .. start + rows positions; sharp softmaxes (queries x3). -> q, k, v,
    tables, lens, runs."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-(start + rows) // block_size) for start, rows in chunks]
    num_blocks = sum(widths) + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).bfloat16()
    ids = torch.randperm(num_blocks, generator=g).to(torch.int32)
    total = sum(rows for _, rows in chunks)
    tables = torch.zeros(total, max(widths), dtype=torch.int32)
    lens = torch.zeros(total, dtype=torch.int32)
    runs, row, used = [], 0, 0
    for (start, rows), width in zip(chunks, widths):
        tables[row:row + rows, :width] = ids[used:used + width]
        lens[row:row + rows] = torch.arange(start + 1, start + rows + 1, dtype=torch.int32)
        runs.append((row, rows))
        row, used = row + rows, used + width
    q = torch.randn(total, heads, dim, generator=g) * 3
    return q, k_cache, v_cache, tables, lens, torch.tensor(runs, dtype=torch.int64)



def tiny_backend(max_positions: int) -> cpu_kernel_backend.CpuKernelAttention:
    """The C kernel backend for the default model's attention shape (9 query heads over 3 KV heads
    of 64, blocks of 16)."""
    from nightshift.engine.model_config import ModelConfig
    config = ModelConfig(architecture="llama", hidden_size=576, num_layers=1, num_heads=9, num_kv_heads=3,
                         head_dim=64, intermediate_size=64, vocab_size=100, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=max_positions, tie_word_embeddings=True)
    return cpu_kernel_backend.CpuKernelAttention(config, 16, torch.float32, torch.device("cpu"))


def tile_calls(monkeypatch) -> list:
    """From now on, the `runs` of every prefill_attention call, in order (the calls still run)."""
    calls = []
    tiles = cpu_prefill_attention.prefill_attention
    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention", lambda *a: calls.append(a[6].tolist()) or tiles(*a))
    return calls

@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 4), (8, 1, 128, 16),
                                                             (6, 2, 64, 8), (8, 2, 64, 16)])
def test_tiles_match_softmax_attention(heads, kv_heads, dim, block_size):
    """Chunks of 1, 5, 16, 17 and 40 rows (whole and partial tiles) at starts inside and on block
    boundaries, query heads per KV head 3, 1, 8 (= 3 + 3 + 2), 3 and 4 (= 3 + 1), head dims 64, 32
    and 128: the paged kernel's bits on every row (so within 1e-5 of attention with the same
    roundings); rows of no run are left as they were."""
    assert cpu_prefill_attention.supports(heads, kv_heads, dim, torch.bfloat16, block_size)
    chunks = [(0, 1), (3, 5), (2 * block_size, 16), (7, 17), (0, 40), (block_size + 1, 40)]
    q, k_cache, v_cache, tables, lens, runs = chunk_pool(heads, kv_heads, dim, block_size, chunks)
    mine = runs[[0, 1, 2, 4, 5]]                # the 17-row chunk is not asked for
    out = torch.full_like(q, 7.0)
    cpu_prefill_attention.prefill_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, mine, out)
    skipped = torch.zeros(q.shape[0], dtype=torch.bool)
    skipped[int(runs[3, 0]):int(runs[3].sum())] = True
    assert torch.all(out[skipped] == 7.0)
    check_against_reference(out[~skipped], q[~skipped], k_cache, v_cache, tables[~skipped].contiguous(),
                            lens[~skipped], dim ** -0.5, False)
    assert cpu_paged_attention.bf16_products(heads // kv_heads, dim, False, torch.bfloat16)
    paged = cpu_paged_attention.paged_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5)
    assert torch.equal(out[~skipped], paged[~skipped])


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("window", [2, 5, 16, 23, 70])
def test_a_sliding_window_sees_only_each_row_s_last_positions(window, pool):
    """Windows of two positions, shorter than a block, a block, between blocks and longer than every
    row, over a bfloat16 and a float32 pool: the paged kernel's bits (within 1e-5 of windowed
    attention with the same roundings); the table entries of blocks wholly before the run's first
    row's window are never read (here ids far outside the pool: reading one would fault or give
    garbage)."""
    chunks = [(0, 9), (20, 40), (45, 17), (3, 1)]
    q, k_cache, v_cache, tables, lens, runs = chunk_pool(9, 3, 64, 16, chunks, seed=window)
    k_cache, v_cache = k_cache.to(pool), v_cache.to(pool)
    for first, rows in runs.tolist():
        before = max(0, int(lens[first]) - window) // 16        # blocks wholly before the first row's window
        tables[first:first + rows, :before] = 10 ** 8
    out = torch.zeros_like(q)
    cpu_prefill_attention.prefill_attention(q, k_cache, v_cache, tables, lens, 64 ** -0.5, runs, out, window)
    check_against_reference(out, q, k_cache, v_cache, tables.clamp(max=k_cache.shape[0] - 1), lens, 64 ** -0.5,
                            False, window=window)
    paged = cpu_paged_attention.paged_attention(q, k_cache, v_cache, tables, lens, 64 ** -0.5, window=window)
    assert torch.equal(out, paged)
    with pytest.raises(ValueError):
        cpu_prefill_attention.prefill_attention(q, k_cache, v_cache, tables, lens, 1.0, runs, out, 0)


@needs_kernel
def test_a_row_does_not_depend_on_the_chunk_around_it():
    """The same 40 rows as one run, as runs of 16 + 24 or 7 + 33, and one of them alone: the same bits
    (positions past a row's length add exact zeros; a tile's other lanes are never mixed in)."""
    q, k_cache, v_cache, tables, lens, runs = chunk_pool(9, 3, 64, 16, [(50, 40)], seed=1)
    scale = 64 ** -0.5

    def attend(split) -> torch.Tensor:
        out = torch.zeros_like(q)
        return cpu_prefill_attention.prefill_attention(q, k_cache, v_cache, tables, lens, scale,
                                                       torch.tensor(split, dtype=torch.int64), out)

    whole = attend([[0, 40]])
    assert torch.equal(whole, attend([[0, 16], [16, 24]]))
    assert torch.equal(whole, attend([[0, 7], [7, 33]]))
    assert torch.equal(whole[23], attend([[23, 1]])[23])
    assert not torch.equal(whole[23], whole[22])


def test_only_whole_dim_pairs_even_blocks_and_float_pools_are_supported():
    assert not cpu_prefill_attention.supports(6, 2, 48, torch.bfloat16, 16)
    assert not cpu_prefill_attention.supports(6, 2, 48, torch.float32, 16)
    assert not cpu_prefill_attention.supports(9, 3, 64, torch.bfloat16, 5)      # the paged kernel's pairs differ
    assert not cpu_prefill_attention.supports(9, 3, 64, torch.float16, 16)
    with pytest.raises(ValueError):
        cpu_prefill_attention.load(3, 64, torch.float16)


@needs_f32_kernel
@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 4), (8, 1, 128, 16),
                                                             (6, 2, 64, 8), (8, 2, 64, 16)])
def test_a_float32_pool_s_tiles_give_the_paged_kernel_s_float32_bits(heads, kv_heads, dim, block_size):
    """Over a float32 pool (the float32 CPU math's) the tiles multiply in float32 as the paged
    kernel's float32 form does (no bfloat16 rounding anywhere) and give its bits on every row,
    chunk shape, window and long context; so the float32 path's results are those it always had."""
    chunks = [(0, 1), (3, 5), (2 * block_size, 16), (7, 17), (0, 40), (block_size + 1, 40), (600, 20)]
    q, k_cache, v_cache, tables, lens, runs = chunk_pool(heads, kv_heads, dim, block_size, chunks)
    g = torch.Generator().manual_seed(5)
    k_cache = k_cache.float() + torch.randn(k_cache.shape, generator=g) * 1e-2     # not bfloat16 values
    v_cache = v_cache.float() + torch.randn(v_cache.shape, generator=g) * 1e-2
    out = torch.zeros_like(q)
    cpu_prefill_attention.prefill_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, runs, out)
    assert torch.equal(out, cpu_paged_attention.paged_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5))
    check_against_reference(out, q, k_cache, v_cache, tables, lens, dim ** -0.5, False)
    for window in (5, 23):
        out = torch.zeros_like(q)
        cpu_prefill_attention.prefill_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, runs, out, window)
        paged = cpu_paged_attention.paged_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, window=window)
        assert torch.equal(out, paged)


@needs_f32_kernel
def test_over_a_float32_pool_the_backend_tiles_only_long_chunks_over_long_contexts(monkeypatch):
    """A float32 pool's step: the runs of at least F32_TILE_MIN_ROWS rows whose last row reads at
    least F32_TILE_MIN_CONTEXT positions go to the tiles, the other chunks' rows with the decode
    rows to the paged kernel; every row the paged kernel's bits."""
    from nightshift.engine.step import StepItem
    backend = tiny_backend(2048)
    wide, ctx = cpu_kernel_backend.F32_TILE_MIN_ROWS, cpu_kernel_backend.F32_TILE_MIN_CONTEXT
    blocks = lambda first, n: list(range(first, first + n))  # noqa: E731
    items = [StepItem([5], 40, blocks(0, 3)),                                  # a decode row
             StepItem(list(range(wide)), ctx, blocks(3, 36)),                  # wide, long: tiles
             StepItem(list(range(20)), ctx, blocks(39, 35)),                   # too few rows for float32 tiles
             StepItem(list(range(wide + 8)), 10, blocks(74, 4))]               # too short a context
    meta = backend.build_metadata(items)
    rows = meta.rows
    assert rows.runs.shape[0] == 3 and rows.f32_runs.tolist() == [[1, wide]]
    assert rows.f32_paged.tolist() == [0, *range(1 + wide, rows.num_rows)]
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(78, 16, 3, 64, generator=g)
    v_cache = torch.randn(78, 16, 3, 64, generator=g)
    q = torch.randn(rows.num_rows, 9, 64, generator=g)
    calls = tile_calls(monkeypatch)
    out = backend.forward(q, None, None, k_cache, v_cache, meta, 0.125)
    assert calls == [[[1, wide]]]
    paged = cpu_paged_attention.paged_attention(q, k_cache, v_cache, rows.block_tables, rows.context_lens, 0.125)
    assert torch.equal(out, paged)
    # without the wide chunk no tiles at all (the bfloat16 pool would tile the other two)
    meta = backend.build_metadata([items[0], items[2], items[3]])
    assert meta.rows.f32_runs.shape[0] == 0 and meta.rows.runs.shape[0] == 2
    q = q[:meta.rows.num_rows]
    out = backend.forward(q, None, None, k_cache, v_cache, meta, 0.125)
    assert calls == [[[1, wide]]]
    assert torch.equal(out, cpu_paged_attention.paged_attention(q, k_cache, v_cache, meta.rows.block_tables,
                                                                meta.rows.context_lens, 0.125))


@needs_kernel
def test_the_rows_bits_are_the_paged_kernel_s_for_long_contexts_and_sharp_or_flat_softmaxes():
    """Rows far into long contexts (the softmax total over thousands of positions, many tiles'
    worth of lane sums), queries scaled up (one position takes nearly all the weight) and down (a
    flat softmax): the paged kernel's bits every time; a mutation of the order of any sum shows
    here as last-bit differences on most rows."""
    for scale, seed in ((64 ** -0.5, 11), (8.0, 12), (1e-3, 13)):
        q, k_cache, v_cache, tables, lens, runs = chunk_pool(9, 3, 64, 16, [(2000, 37), (300, 70)], seed=seed)
        out = torch.zeros_like(q)
        cpu_prefill_attention.prefill_attention(q, k_cache, v_cache, tables, lens, scale, runs, out)
        assert torch.equal(out, cpu_paged_attention.paged_attention(q, k_cache, v_cache, tables, lens, scale))


@needs_kernel
def test_the_backend_takes_decode_rows_and_short_chunks_through_the_paged_kernel_and_longer_chunks_as_tiles(
        monkeypatch):
    """A mixed step's metadata: the decode rows first, then the chunks shorter than TILE_MIN_ROWS,
    then one run per longer chunk; its output the paged kernel's bits on every row."""
    from nightshift.engine.step import StepItem
    backend = tiny_backend(512)
    short = cpu_kernel_backend.TILE_MIN_ROWS - 1
    items = [StepItem(list(range(20)), 0, [0, 1]), StepItem([5], 40, [2, 3, 4]),
             StepItem(list(range(short)), 17, [5, 6]), StepItem([9], 3, [7]), StepItem(list(range(18)), 30, [8, 9, 10])]
    meta = backend.build_metadata(items)
    rows = meta.rows
    assert meta.item_order == [1, 3, 2, 0, 4] and rows.num_paged == 2 + short
    assert rows.runs.tolist() == [[2 + short, 20], [22 + short, 18]]
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(11, 16, 3, 64, generator=g).bfloat16()
    v_cache = torch.randn(11, 16, 3, 64, generator=g).bfloat16()
    q = torch.randn(rows.num_rows, 9, 64, generator=g)
    calls = tile_calls(monkeypatch)
    out = backend.forward(q, None, None, k_cache, v_cache, meta, 0.125)
    assert len(calls) == 1
    paged = cpu_paged_attention.paged_attention(q, k_cache, v_cache, rows.block_tables, rows.context_lens, 0.125)
    assert torch.equal(out, paged)
    check_against_reference(out, q, k_cache, v_cache, rows.block_tables, rows.context_lens, 0.125, False)


def untiled(patch) -> None:
    """Every row through the paged kernel (a `shared_prompt_logits` patch)."""
    patch.setattr(cpu_prefill_attention, "supports", lambda *a: False)


def shared_prompt_logits(model, monkeypatch, prompt: list[int], own: list[list[int]], forced: list[list[int]],
                         patches=None, split: int = 0) -> torch.Tensor:
    """The logits of a fresh runner over `prompt` (whole blocks, prefilled alone), then each
    continuation of `own` prefilled over it in one step (with `split`: its first `split` tokens in a
    step before, without logits), then one `forced` token a step for each; `patches(patch)`, where
    given, sets a monkeypatch context up around the run (e.g. `untiled`)."""
    from nightshift.engine.model_runner import ModelRunner
    from nightshift.engine.step import StepItem
    shared, rows = len(prompt), len(own)
    per = -(-(max(len(o) for o in own) + len(forced[0])) // 16)      # each continuation's own blocks
    runner = ModelRunner(model, num_kv_blocks=shared // 16 + rows * per, block_size=16)
    tables = [list(range(shared // 16)) + [shared // 16 + per * i + j for j in range(per)] for i in range(rows)]
    with monkeypatch.context() as patch:
        if patches is not None:
            patches(patch)
        steps = [runner.execute([StepItem(prompt, 0, tables[0])])]
        if split:
            runner.execute([StepItem(o[:split], shared, t, False) for o, t in zip(own, tables)])
        steps.append(runner.execute([StepItem(o[split:], shared + split, t) for o, t in zip(own, tables)]))
        for step in range(len(forced[0])):
            steps.append(runner.execute([StepItem([f[step]], shared + len(o) + step, t)
                                         for f, o, t in zip(forced, own, tables)]))
    return torch.cat(steps)


@needs_kernel
@pytest.mark.slow
def test_the_default_model_on_bf16_math_gives_the_same_logits_however_its_prompts_are_chunked(
        default_model_path, monkeypatch):
    """Twelve prompts sharing a cached system prompt, prefilled together (one run each), then decoded
    with forced tokens through the fused bf16 layers: the same logits, bit for bit, with the chunks
    as tiles, with every row through the paged kernel, and with each prompt split into a chunk of 7
    rows (the paged kernel) and one of the rest (tiles) over two steps."""
    from nightshift.engine.layers import cpu_math
    from nightshift.engine.loader import load_model
    if "bf16" not in cpu_math.supported():
        pytest.skip("no bf16 CPU math here")
    model = load_model(default_model_path, dtype=torch.float32, cpu_math="bf16")
    g = torch.Generator().manual_seed(4)
    rows, shared = 12, 5 * 16
    prompt = torch.randint(100, 40000, (shared,), generator=g).tolist()
    own = [torch.randint(100, 40000, (int(n),), generator=g).tolist()
           for n in torch.randint(20, 60, (rows,), generator=g)]
    forced = torch.randint(100, 40000, (rows, 4), generator=g).tolist()
    calls = tile_calls(monkeypatch)
    run = lambda patches=None, split=0: shared_prompt_logits(model, monkeypatch, prompt, own, forced,  # noqa: E731
                                                             patches, split)

    tiled = run()
    assert len(calls) == 2 * model.config.num_layers      # the two prefill steps, every layer
    assert torch.equal(tiled, run(untiled))
    calls.clear()
    assert torch.equal(tiled, run(split=7))
    assert len(calls) == 2 * model.config.num_layers      # the 7-row chunks on the paged kernel, the rest tiles


@needs_f32_kernel
@pytest.mark.slow
def test_the_default_model_on_float32_math_gives_the_same_logits_with_float32_tiles(default_model_path,
                                                                                   monkeypatch):
    """The float32 CPU math (a float32 pool): a 512-token prompt and four 40-token continuations of
    it prefilled over the cached prompt (both steps' chunks long enough for the float32 tiles), then
    forced decode steps: the same logits, bit for bit, as with every row through the paged kernel."""
    from nightshift.engine.loader import load_model
    model = load_model(default_model_path, dtype=torch.float32, cpu_math="float32")
    assert model.kv_dtype == torch.float32
    g = torch.Generator().manual_seed(6)
    rows, shared = 4, 32 * 16
    prompt = torch.randint(100, 40000, (shared,), generator=g).tolist()
    own = [torch.randint(100, 40000, (40,), generator=g).tolist() for _ in range(rows)]
    forced = torch.randint(100, 40000, (rows, 3), generator=g).tolist()
    calls = tile_calls(monkeypatch)

    tiled = shared_prompt_logits(model, monkeypatch, prompt, own, forced)
    assert len(calls) == 2 * model.config.num_layers
    assert torch.equal(tiled, shared_prompt_logits(model, monkeypatch, prompt, own, forced, untiled))

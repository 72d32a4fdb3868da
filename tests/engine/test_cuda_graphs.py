"""CUDA graphs of decode steps (engine/cuda_graphs.py): the buckets and the one-buffer input layout
on any machine; on a CUDA GPU, a replayed runner against an eager one over mixed steps. Without a
GPU the graph half checks that the runner stays eager (graphs need CUDA)."""
import pytest
import torch

from bench.dummy_weights import build_dummy_model
from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.step import StepItem


def _graph_module():
    pytest.importorskip("triton")
    from nightshift.engine import cuda_graphs
    return cuda_graphs


def test_buckets():
    graphs = _graph_module()
    assert [graphs.batch_bucket(b) for b in (1, 2, 3, 17, 256, 257, 512)] == [1, 2, 4, 24, 256, 320, 512]
    assert graphs.batch_bucket(513) is None
    assert [graphs.width_bucket(b) for b in (1, 8, 9, 33, 100)] == [8, 8, 16, 64, 128]


def test_layout_fills_one_buffer_with_the_step_and_inert_padding():
    graphs = _graph_module()
    layout = graphs._Layout(batch=4, width=8)
    host = torch.full((layout.size + 5,), 77, dtype=torch.int32)
    items = [StepItem([11], 20, [3, 9]), StepItem([12], 5, [4]), StepItem([13], 16, [7, 2, 99])]
    layout.fill(host[:layout.size], items, block_size=16)
    ids, positions, slots, lens, tables = layout.views(host)
    assert ids.tolist() == [11, 12, 13, 0]
    assert positions.tolist() == [20, 5, 16, 0]
    assert slots.tolist() == [9 * 16 + 4, 4 * 16 + 5, 2 * 16 + 0, -1]     # padding stores nothing
    assert lens.tolist() == [21, 6, 17, 1]
    assert tables.tolist() == [[3, 9, 0, 0, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0, 0],
                               [7, 2, 0, 0, 0, 0, 0, 0], [0] * 8]     # blocks past the context are not sent
    assert host[layout.size:].tolist() == [77] * 5                    # nothing written past the layout


def _steps(vocab: int, runner_eager, runner_graphs, steps: int = 40):
    """Prefill 5 prompts of mixed lengths on both runners, then decode (teacher-forced by the eager
    runner's greedy tokens) while sequences finish, so the batch and context buckets change."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 17, 40, 64, 100]
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(lengths))]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    items = [StepItem(p, 0, t) for p, t in zip(prompts, tables)]
    eager = runner_eager.execute(items)
    replayed = runner_graphs.execute(items)
    yield eager, replayed
    tokens = eager.argmax(-1).tolist()
    pos = list(lengths)
    alive = list(range(len(lengths)))
    for step in range(steps):
        if step in (10, 25):
            alive = alive[1:]                        # a sequence finishes: batch 5 -> 4 -> 3
        items = [StepItem([tokens[i]], pos[i], tables[i], need_logits=(i != alive[-1] or step % 2 == 0))
                 for i in alive]
        eager = runner_eager.execute(items)
        replayed = runner_graphs.execute(items)
        yield eager, replayed
        wanted = [i for i in alive if i != alive[-1] or step % 2 == 0]
        for row, i in enumerate(wanted):
            tokens[i] = int(eager[row].argmax())
        for i in alive:
            pos[i] += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_decode_steps_match_eager_ones(dtype):
    model = build_dummy_model("llama-tiny", dtype, "cuda" if torch.cuda.is_available() else "cpu")
    eager = ModelRunner(model, num_kv_blocks=96, block_size=16, enforce_eager=True)
    replayed = ModelRunner(model, num_kv_blocks=96, block_size=16)
    assert eager.graphs is None
    if not torch.cuda.is_available():
        assert replayed.graphs is None      # graphs are CUDA-only: the CPU runner is eager
        return
    assert replayed.graphs is not None
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in _steps(model.config.vocab_size, eager, replayed):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=tolerance * a.abs().max().item(), rtol=0), (a - b).abs().max()
        margin = a.topk(2, dim=-1).values
        clear = (margin[:, 0] - margin[:, 1]) > 2 * tolerance * a.abs().max()
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
    # batch 5, 4, 3 -> buckets 8 and 4; contexts up to ~140 tokens -> widths 8 and 16
    assert {batch for batch, _ in replayed.graphs.captured} == {4, 8}
    assert {width for _, width in replayed.graphs.captured} <= {8, 16}

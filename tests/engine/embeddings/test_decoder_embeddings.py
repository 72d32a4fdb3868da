"""Decoder-based embedding models (the Qwen3-Embedding shape, embeddings/decoder.py) against
sentence-transformers' own encode() on tiny random Qwen3 / Qwen2 / Llama models built with
transformers and saved as sentence-transformers folders (as Qwen3-Embedding ships: a bare
`Qwen3Model` checkpoint, lasttoken pooling, Normalize), with the default model's tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nightshift.engine.embeddings import EmbeddingEngine, EmbeddingRequest
from nightshift.engine.embeddings.decoder import DecoderEncoder, EmbeddingCheckpoint, build_decoder_encoder
from nightshift.engine.tokenizer import load_tokenizer

TEXTS = [
    "hello", "The quick brown fox jumps over the lazy dog.", "a",
    "東京都の天気は晴れです。明日は雨が降るでしょう。", "def f(x):\n    return x ** 2  # square",
    "word " * 300,                                   # past max_seq_length (64): truncated
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;", "naïve café façade Zürich crème brûlée",
    "A somewhat longer sentence, with punctuation; and a few clauses that go on for a while.",
    "1234567890 3.14159 2.71828 -42", "Hello, world!",
]
MAX_SEQ_LENGTH = 64
ST = "sentence_transformers.models."


def _hf_model(family: str, seed: int = 0):
    """A tiny random transformers base model (no LM head) of `family`, with non-trivial norms."""
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False)
    if family == "qwen3":
        model = transformers.Qwen3Model(transformers.Qwen3Config(head_dim=16, **common))
    elif family == "qwen2":     # q/k/v biases
        model = transformers.Qwen2Model(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaModel(transformers.LlamaConfig(**common))
    with torch.no_grad():       # norms away from 1 and biases away from 0, so a wrong one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


def _save_tokenizer(folder: Path, padding_side: str = "right", append_eos: bool = False) -> None:
    source = load_tokenizer("default")
    backend = source.backend
    if append_eos:      # as Qwen3-Embedding's updated tokenizer: every text ends in <|endoftext|>
        from tokenizers.processors import TemplateProcessing
        eos = "<|endoftext|>"
        backend.post_processor = TemplateProcessing(single=f"$A {eos}",
                                                    special_tokens=[(eos, backend.token_to_id(eos))])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|im_end|>",
        "padding_side": padding_side, "model_max_length": 512}))
    # transformers 5 may rebuild a tokenizer by the config's model type (Qwen2Tokenizer puts its own
    # pre-tokenizer on the vocabulary): tokenizer.json is rewritten as transformers builds it, so
    # the folder is self-consistent, as a real model's is
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer.save(str(folder / "tokenizer.json"))


def _st_folder(folder: Path, family: str = "qwen3", pooling: str = "lasttoken", normalize: bool = True,
               padding_side: str = "right", append_eos: bool = False, seed: int = 0) -> Path:
    """A sentence-transformers folder as Qwen3-Embedding's: Transformer (bare base-model
    weights at the root), Pooling, optional Normalize."""
    folder.mkdir(parents=True)
    _hf_model(family, seed).save_pretrained(str(folder))
    _save_tokenizer(folder, padding_side, append_eos)
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    modes = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens",
             "mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "weightedmean": "weightedmean_tokens",
             "lasttoken": "lasttoken"}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **{f"pooling_mode_{key}": mode == pooling for mode, key in modes.items()},
         "include_prompt": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH,
                                                                  "do_lower_case": False}))
    return folder


def _reference(folder: Path, texts=TEXTS, batch_size: int = 4) -> np.ndarray:
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(list(texts), batch_size=batch_size, convert_to_numpy=True)


def _assert_matches(ours: np.ndarray, reference: np.ndarray) -> None:
    assert ours.shape == reference.shape and ours.dtype == np.float32
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.9999, [(TEXTS[i][:30], float(cosine[i])) for i in np.argsort(cosine)[:3]]
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=1e-4)


def _check_one_batch_and_split(folder: Path) -> EmbeddingEngine:
    reference = _reference(folder)
    one = EmbeddingEngine.from_pretrained(str(folder), dtype="float32", max_batch_tokens=4096, workers=1)
    before = one.stats().num_steps
    _assert_matches(one.embed(TEXTS), reference)
    assert one.stats().num_steps - before == 1
    # split over several steps, on two worker threads
    split = EmbeddingEngine.from_pretrained(str(folder), dtype="float32", max_batch_tokens=80, workers=2)
    before = split.stats().num_steps
    _assert_matches(split.embed(TEXTS), reference)
    assert split.stats().num_steps - before >= 4
    return one


@pytest.fixture(scope="module")
def qwen3_lasttoken(tmp_path_factory) -> Path:
    return _st_folder(tmp_path_factory.mktemp("emb") / "qwen3-lasttoken")


def test_qwen3_lasttoken_normalized_matches_sentence_transformers(qwen3_lasttoken):
    engine = _check_one_batch_and_split(qwen3_lasttoken)
    assert isinstance(engine.encoder, DecoderEncoder)
    assert engine.files.pooling.modes == ("lasttoken",) and engine.normalized
    assert (engine.dimension, engine.max_seq_length, engine.vocab_size) == (64, MAX_SEQ_LENGTH, 49152)
    np.testing.assert_allclose(np.linalg.norm(engine.embed(TEXTS), axis=1), 1.0, atol=1e-5)
    # the long text was cut at max_seq_length, as sentence-transformers cuts it
    (out,) = engine.embed_requests([EmbeddingRequest("r", [TEXTS[5]])])
    assert out.prompt_tokens == MAX_SEQ_LENGTH and out.truncated_inputs == 1


def test_the_bare_checkpoint_names_are_read(qwen3_lasttoken):
    # a Qwen3Model saves "embed_tokens.weight", not "model.embed_tokens.weight", and no lm_head
    checkpoint = EmbeddingCheckpoint(None, sorted(qwen3_lasttoken.glob("*.safetensors")))
    assert checkpoint.prefix == ""
    assert checkpoint.tensor("model.embed_tokens.weight").shape == (49152, 64)
    assert checkpoint.tensor("lm_head.weight") is None


def test_the_final_norm_states_match_transformers(qwen3_lasttoken):
    """Token states before pooling, per sequence, against transformers' last_hidden_state."""
    import transformers
    from nightshift.engine.embeddings.varlen import VarlenBatch
    reference_model = transformers.AutoModel.from_pretrained(str(qwen3_lasttoken)).eval()
    config = json.loads((qwen3_lasttoken / "config.json").read_text())
    for pack in (False, True):
        encoder = build_decoder_encoder(config, sorted(qwen3_lasttoken.glob("*.safetensors")), pack_weights=pack)
        sequences = [[5, 17, 900, 3000, 12], [7], [44, 45, 46, 47, 48], [100, 200, 300, 400, 500, 600, 700]]
        batch = VarlenBatch.build([len(s) for s in sequences])
        with torch.inference_mode():
            ours = encoder(torch.tensor([t for s in sequences for t in s]), batch)
            cu = batch.cu_seqlens.tolist()
            for i, seq in enumerate(sequences):
                theirs = reference_model(input_ids=torch.tensor([seq])).last_hidden_state[0]
                torch.testing.assert_close(ours[cu[i]:cu[i + 1]], theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, padding_side", [("qwen3", "left"), ("qwen2", "right"), ("llama", "left")])
def test_mean_pooling_without_normalize_matches_sentence_transformers(tmp_path, family, padding_side):
    folder = _st_folder(tmp_path / family, family, pooling="mean", normalize=False, padding_side=padding_side,
                        seed=1)
    engine = _check_one_batch_and_split(folder)
    assert engine.files.pooling.modes == ("mean",) and not engine.normalized
    assert engine.encoder.config.model_type == family


def test_lasttoken_with_a_tokenizer_that_appends_eos(tmp_path):
    # Qwen3-Embedding's updated tokenizer.json ends every text with <|endoftext|>: pooled there
    folder = _st_folder(tmp_path / "eos", append_eos=True, padding_side="left", seed=2)
    engine = _check_one_batch_and_split(folder)
    eos = engine.tokenizer.backend.token_to_id("<|endoftext|>")
    assert engine.tokenizer.suffix == [eos]
    ids = [ids for ids, _ in engine.tokenizer.encode_texts(TEXTS)]
    assert all(seq[-1] == eos for seq in ids) and max(len(s) for s in ids) == MAX_SEQ_LENGTH
    # a token array gets the same EOS, so it embeds as its text
    arrays = [engine.tokenizer.backend.encode(t, add_special_tokens=False).ids for t in TEXTS[:3]]
    np.testing.assert_allclose(engine.embed(arrays), engine.embed(TEXTS[:3]), atol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["Qwen3ForCausalLM", "Qwen3Model"])
def test_a_plain_hf_folder_pools_as_sentence_transformers_defaults(tmp_path, causal):
    """A folder without modules.json is read as sentence-transformers 6 reads it: last-token
    pooling for a `...ForCausalLM` (here with "model."-prefixed weights and an lm_head, never
    built), mean pooling for a bare base model; no normalisation either way."""
    import transformers
    base = _hf_model("qwen3", seed=3)
    folder = tmp_path / "plain"
    if causal:
        model = transformers.Qwen3ForCausalLM(base.config)
        model.model = base
        model.eval().save_pretrained(str(folder))
    else:
        base.save_pretrained(str(folder))
    _save_tokenizer(folder)
    engine = EmbeddingEngine.from_pretrained(str(folder), dtype="float32", max_batch_tokens=4096, workers=1)
    assert engine.files.pooling.modes == (("lasttoken",) if causal else ("mean",)) and not engine.normalized
    assert not isinstance(engine.encoder.model.lm_head, torch.nn.Linear)   # the head is never built
    texts = TEXTS[:5] + TEXTS[6:]           # no truncation: the plain folder's limit is 512 tokens
    reference = _reference(folder, texts)
    ours = engine.embed(texts)
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.9999
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=1e-4)


def test_cls_pooling_is_refused_for_a_decoder(tmp_path):
    folder = _st_folder(tmp_path / "cls", pooling="cls")
    with pytest.raises(ValueError, match="cls pooling is not supported for a decoder"):
        EmbeddingEngine.from_pretrained(str(folder), dtype="float32")

"""Our tokenizer (built from GGUF metadata / HF tokenizer files) vs transformers' on the same GGUF."""
from __future__ import annotations

import time
from collections.abc import Mapping

import pytest

from nightshift.engine.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_hf_dir

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world",
    "  leading spaces and trailing   ",
    "Numbers 1234567 and 3.14159, dates 2024-01-31.",
    "Unicode: café, naïve, Zürich, 東京, Привет, emoji 🎉🚀 and combining é",
    "def f(x):\n\treturn x ** 2  # comment\n\n\nclass A: pass",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<|endoftext|>",
    "It's don't we'll they've I'm you'd SHOUTING mixedCase",
    "\n\n\n   \t  \r\n",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another, in 日本語?"}],
]


@pytest.fixture(scope="module")
def ours(default_model_path):
    return load_tokenizer(default_model_path)


def hf_chat_ids(hf_tokenizer, messages, add_generation_prompt):
    out = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, hf_tokenizer, text):
    ids = ours.encode(text)
    assert ids == hf_tokenizer.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf_tokenizer, messages, add_generation_prompt):
    text = ours.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt) == \
        hf_chat_ids(hf_tokenizer, messages, add_generation_prompt)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_special_ids_and_vocab(ours, hf_tokenizer):
    assert ours.vocab_size == len(hf_tokenizer) == 49152
    assert ours.eos_token_ids == [hf_tokenizer.eos_token_id] == [2]
    assert ours.bos_token_id == hf_tokenizer.bos_token_id


def test_chat_template_errors_are_clear(ours):
    with pytest.raises(ValueError, match="list of objects"):
        ours.apply_chat_template("just a string")


def test_cached_load_is_cheap(default_model_path, ours, tmp_path):
    start = time.perf_counter()
    again = load_tokenizer("default")
    assert time.perf_counter() - start < 2.0
    assert again.encode(TEXTS[3]) == ours.encode(TEXTS[3])
    ours.save(tmp_path)
    assert Tokenizer.load(tmp_path).apply_chat_template(CHATS[1]) == ours.apply_chat_template(CHATS[1])


def test_hf_directory_tokenizer_matches(hf_tokenizer, tmp_path):
    """A HF directory written by transformers (tokenizer.json etc.) loads to the same tokenizer."""
    hf_tokenizer.save_pretrained(tmp_path)
    ours = tokenizer_from_hf_dir(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == hf_tokenizer.encode(text)
    for messages in CHATS:
        assert ours.apply_chat_template(messages) == hf_chat_ids(hf_tokenizer, messages, True)
    assert ours.eos_token_ids == [2]


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_into_the_text(ours, text):
    """Each token's own bytes (logprobs' ``bytes``): pieces of a multi-byte character, which decode
    alone to U+FFFD, keep their bytes, so the tokens' bytes join into the text."""
    ids = ours.encode(text, add_special_tokens=False)
    assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_a_split_character_and_a_special_token(ours):
    ids = ours.encode("日", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in ours.decode(ids[:1], skip_special_tokens=False)
    assert ours.token_bytes(ids[0]) == "日".encode()[:len(ours.token_bytes(ids[0]))]
    im_end = ours.backend.token_to_id("<|im_end|>")
    assert ours.token_bytes(im_end) == b"<|im_end|>"


def test_token_bytes_of_a_sentencepiece_vocabulary():
    """A SentencePiece-style vocabulary ("\u2581" for a space, <0xNN> byte-fallback tokens), as
    Llama-2 / Mistral tokenizer.json files have."""
    from tokenizers import Tokenizer as Backend, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "<0xE6>": 2, "<0x97>": 3, "<0xA5>": 4, "\u2581hi": 5, "\u2581": 6, "h": 7, "i": 8,
             "hi": 9}
    backend = Backend(models.BPE(vocab=vocab, merges=[("h", "i"), ("\u2581", "hi")], unk_token="<unk>",
                                 byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(["<s>"])
    sp = Tokenizer(backend, None, {"bos_token": "<s>"}, [])
    assert [sp.token_bytes(i) for i in (5, 2, 3, 4, 1)] == [b" hi", b"\xe6", b"\x97", b"\xa5", b"<s>"]
    assert b"".join(sp.token_bytes(i) for i in (5, 6, 2, 3, 4)).decode() == " hi 日"

"""Texts and token arrays to the ids the encoder runs, truncated as sentence-transformers does.

tokenizer.json often carries a fixed padding and a truncation length of its own (all-MiniLM-L6-v2's
pads to 128 and truncates at 128); sentence-transformers overrides both with its own
max_seq_length, and so do we: no padding, truncation at `max_length` tokens special tokens
included ([CLS] and [SEP] are kept, the text is cut). Token arrays are the text's tokens without
special tokens; they get the same special tokens a text gets, so both embed alike.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as BackendTokenizer

_PROBE = "hello"   # any text of plain word pieces: encoding it shows where the special tokens go


class EmbeddingTokenizer:
    def __init__(self, backend: BackendTokenizer, max_length: int, lower_case: bool = False):
        self.backend = backend
        self.max_length = max_length
        self.lower_case = lower_case
        backend.no_padding()
        backend.no_truncation()   # tokenizer.json's own limit goes; the probe below needs none
        bare = backend.encode(_PROBE, add_special_tokens=False).ids
        full = backend.encode(_PROBE, add_special_tokens=True).ids
        start = _find(full, bare)
        if start < 0:
            raise ValueError("the tokenizer's special tokens could not be located around a plain text")
        self.prefix, self.suffix = full[:start], full[start + len(bare):]
        if max_length <= len(self.prefix) + len(self.suffix):
            raise ValueError(f"max_length {max_length} leaves no room for text between the special tokens")
        backend.enable_truncation(max_length)   # counts the special tokens, keeps them; cut: `overflowing`

    @classmethod
    def from_file(cls, path: Path, max_length: int, lower_case: bool = False) -> "EmbeddingTokenizer":
        return cls(BackendTokenizer.from_file(str(path)), max_length, lower_case)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def num_special_tokens(self) -> int:
        return len(self.prefix) + len(self.suffix)

    def encode_texts(self, texts: list[str]) -> list[tuple[list[int], bool]]:
        """(ids, truncated) per text, special tokens added; one batched call (the Rust tokenizer
        spreads it over its own threads)."""
        if self.lower_case:
            texts = [t.lower() for t in texts]
        return [(e.ids, bool(e.overflowing)) for e in self.backend.encode_batch(texts, add_special_tokens=True)]

    def wrap_tokens(self, tokens: list[int]) -> tuple[list[int], bool]:
        """A token array with the special tokens around it, cut to max_length."""
        room = self.max_length - self.num_special_tokens
        return self.prefix + list(tokens[:room]) + self.suffix, len(tokens) > room


def _find(haystack: list[int], needle: list[int]) -> int:
    for start in range(len(haystack) - len(needle) + 1):
        if haystack[start:start + len(needle)] == needle:
            return start
    return -1


def default_max_length(max_positions: int, tokenizer_config: Optional[dict], st_max_seq_length: Optional[int]) -> int:
    """sentence_bert_config.json's max_seq_length, else tokenizer_config.json's model_max_length;
    never more than the encoder's position table holds."""
    for candidate in (st_max_seq_length, (tokenizer_config or {}).get("model_max_length")):
        if isinstance(candidate, int) and candidate > 0:
            return min(candidate, max_positions)
    return max_positions

"""A deterministic mix of texts to embed, shaped like what a batch embedding job sees.

Documents chunked for retrieval, titles, questions and product descriptions: most texts are a
sentence or a short paragraph, some are long paragraphs, a few run past a 256-token model limit
(they get truncated). Some carry non-ASCII text (accents, CJK, Cyrillic, Arabic, emoji), code or
numbers. Same seed, same texts, on every machine.
"""
from __future__ import annotations

import random

_WORDS = (
    "the a of and to in is for on with as by at from that this it be are was were or an which "
    "batch model service request response token vector search index document query result user "
    "system data store cluster memory latency throughput worker queue shard lease retry error "
    "database table column schema migration backup replica region network packet server client "
    "customer order invoice payment shipping delivery warehouse product price discount review "
    "weather river mountain forest ocean city village harbour bridge railway station museum "
    "history science music painting language grammar novel poem chapter author library "
    "quickly slowly carefully often never always usually sometimes again together nearly "
    "large small bright dark ancient modern simple complex quiet noisy cheap expensive "
    "runs builds reads writes sends returns checks measures compares stores loads keeps "
    "improves reduces increases explains describes requires allows supports prevents"
).split()
_FRAGMENTS = (
    "café crème brûlée", "naïve façade", "Zürich – Genève", "東京都の天気は晴れです", "机器学习模型",
    "Москва и Санкт-Петербург", "مرحبا بالعالم", "emoji 🎉🚀✨", "ß and ø and å", "日本語のテキスト",
    "x = f(y) + 3 * z", "def main(): return 42", "SELECT id FROM users WHERE age > 30;",
    "version 2.13.0", "+1 (555) 010-9999", "$1,299.99", "2024-11-23T12:21:00Z", "https://example.com/a?b=c",
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 18))]
    if rng.random() < 0.25:
        words.insert(rng.randrange(len(words)), rng.choice(_FRAGMENTS))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".!?.")


def _text(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng) for _ in range(sentences))


def embedding_texts(count: int, seed: int = 0) -> list[str]:
    """`count` texts: ~45% one sentence or a title (3-20 tokens), ~35% a short paragraph (2-5
    sentences), ~15% a long paragraph (6-14 sentences, 100-300 tokens), ~5% past 256 tokens
    (16-30 sentences)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        draw = rng.random()
        if draw < 0.45:
            texts.append(_sentence(rng) if rng.random() < 0.7 else " ".join(rng.sample(_WORDS, rng.randint(2, 6))))
        elif draw < 0.80:
            texts.append(_text(rng, rng.randint(2, 5)))
        elif draw < 0.95:
            texts.append(_text(rng, rng.randint(6, 14)))
        else:
            texts.append(_text(rng, rng.randint(16, 30)))
    return texts

"""`python -m bench.embeddings` on a few texts: both sides run, figures and the cosine check printed."""
from __future__ import annotations

from bench.embedding_texts import embedding_texts
from bench.embeddings import parse_args, run


def test_the_text_mix_is_deterministic_and_mixed():
    texts = embedding_texts(400, seed=3)
    assert texts == embedding_texts(400, seed=3) and texts != embedding_texts(400, seed=4)
    words = [len(t.split()) for t in texts]
    assert min(words) <= 6 and max(words) >= 250                 # titles and texts past 256 tokens
    assert any(not t.isascii() for t in texts)


def test_bench_prints_both_sides_and_the_cosine_check():
    lines = []
    report = run(parse_args(["--count", "24", "--st-batch-sizes", "8", "16", "--repeats", "1"]), log=lines.append)
    assert [row.name for row in report.reference] == ["sentence-transformers encode(batch_size=8)",
                                                       "sentence-transformers encode(batch_size=16)"]
    assert report.ours.texts == 24 and report.ours.tokens > 24 and report.ours.texts_per_s > 0
    assert report.best_reference.seconds == min(row.seconds for row in report.reference)
    assert report.ratio == report.best_reference.seconds / report.ours.seconds
    assert report.cosine_min >= 0.999
    printed = "\n".join(lines)
    assert printed.count("texts/s") == 3 and printed.count("tokens/s") == 3
    assert f"{report.ratio:.2f}x" in printed and "cosine to sentence-transformers: min" in printed

"""Batch chat-prompt encoding (engine/chat_prompts.py): the fast renderer and the segment encoder
give exactly what the tokenizer's chat template and encoder give."""
from __future__ import annotations

import pytest

from nightshift.engine.chat_prompts import ChatPromptRenderer, SegmentEncoder, content_is_verbatim
from nightshift.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def test_fast_chat_rendering_equals_the_template(tokenizer):
    renderer = ChatPromptRenderer(tokenizer)
    assert renderer.fast
    chats = [[{"role": "user", "content": "solo"}],
             [{"role": "system", "content": "  spaced \n"}, {"role": "user", "content": "{{ not jinja }} <&>"}],
             [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": ""}],
             [{"role": "user", "content": "has a sentinel \ue000 char"}]]
    for chat in chats:
        assert renderer.render(chat) == tokenizer.render_chat(chat, add_generation_prompt=True)
    # templates that transform or test the content never take the fast path
    assert not content_is_verbatim("{% for m in messages %}{{ m['content'] | trim }}{% endfor %}")
    assert not content_is_verbatim("{% for m in messages %}{% if m.content %}{{ m.content }}{% endif %}{% endfor %}")
    assert not content_is_verbatim("{% for m in messages %}{% set c = m.content %}{{ c }}{% endfor %}")
    assert content_is_verbatim("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}{% endfor %}")


def test_segment_encoder_equals_whole_text_encoding(tokenizer):
    enc = SegmentEncoder(tokenizer)
    assert enc.split is not None
    texts = [tokenizer.render_chat([{"role": "system", "content": "Shared prompt, twice."},
                                    {"role": "user", "content": f"line {i} ünïcode  spaces\n\n"}]) for i in range(50)]
    texts += ["<|im_start|><|im_end|>", "no specials at all", "", "x<|endoftext|>y<|im_start|>"]
    expected = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert enc.encode_many(texts) == expected
    assert enc.encode_many(texts) == expected  # from the cache


def test_chat_prompt_encoder_equals_apply_chat_template(tokenizer):
    encoder = tokenizer.chat_prompt_encoder()
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"question {i}"}] for i in range(5)]
    ids = encoder.encode_many([encoder.render(chat) for chat in chats])
    assert ids == [tokenizer.apply_chat_template(chat) for chat in chats]

"""Many chat prompts to token ids at once (batch ingest tokenizes up to 50,000 lines): the same
ids as ``Tokenizer.apply_chat_template``, much faster. ``ChatPromptEncoder`` is the entry point
(``Tokenizer.chat_prompt_encoder()``).

Rendering: the model's chat template is rendered once per role sequence with sentinel contents,
then each line's contents are spliced into the literal pieces.

Exact, not approximate: the fast path is used only when the template provably inserts
``content`` verbatim — every access to a ``content`` key or attribute in the template's
syntax tree sits in an output expression, at most inside string concatenation (no filter,
test, condition, call or assignment uses it) — and a probe render with awkward characters
matches. Otherwise, for a role
sequence whose sentinels do not come out once each in order, and for a chat with ``tools`` or a
message with a field beside role and content (``tool_calls``, ``tool_call_id``, ``name``), the
tokenizer renders the line.
"""
from __future__ import annotations

from typing import Any, Optional

import jinja2
from jinja2 import nodes
from jinja2.ext import loopcontrols


def _is_content_access(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return False


def content_is_verbatim(template: str) -> bool:
    """True if every use of ``content`` in the template is a bare ``{{ ... }}`` output."""
    try:
        tree = jinja2.Environment(extensions=[loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    found = False

    def walk(node: nodes.Node, ancestors: list[nodes.Node]) -> bool:
        nonlocal found
        if _is_content_access(node):
            found = True
            # allowed: {{ ... }} directly, or inside string concatenation (+ or ~) within {{ ... }}
            for up in reversed(ancestors):
                if isinstance(up, nodes.Output):
                    return True
                if not isinstance(up, (nodes.Add, nodes.Concat)):
                    return False
            return False
        if isinstance(node, nodes.Name) and node.name == "content":
            return False
        return all(walk(child, ancestors + [node]) for child in node.iter_child_nodes())

    return walk(tree, []) and found


class ChatPromptRenderer:
    def __init__(self, tokenizer):  # noqa: ANN001
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.fast = bool(template) and content_is_verbatim(template)
        self._pieces: dict[tuple[str, ...], Optional[list[str]]] = {}
        if self.fast:
            probe = [{"role": "system", "content": " <&> {{x}} \n"}, {"role": "user", "content": "\t'\"%s"}]
            self.fast = self.render(probe) == tokenizer.render_chat(probe, add_generation_prompt=True)

    def _pieces_for(self, roles: tuple[str, ...]) -> Optional[list[str]]:
        if roles not in self._pieces:
            marks = [f"\ue000{i}\ue001" for i in range(len(roles))]
            text = self.tokenizer.render_chat([{"role": r, "content": m} for r, m in zip(roles, marks)],
                                              add_generation_prompt=True)
            pieces: Optional[list[str]] = []
            for mark in marks:
                head, sep, text = text.partition(mark)
                if not sep or mark in text:
                    pieces = None
                    break
                pieces.append(head)
            if pieces is not None:
                pieces.append(text)
            self._pieces[roles] = pieces
        return self._pieces[roles]

    def render(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None) -> str:
        """The same text as ``tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools)``.

        The spliced pieces know only roles and contents: a chat with tools, or a message with
        any other field (tool_calls, tool_call_id, name), is rendered by the template itself."""
        if tools:
            return self.tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools)
        pieces = self._pieces_for(tuple(m["role"] for m in messages)) if self.fast else None
        if pieces is None or any(len(m) != 2 or not isinstance(m.get("content"), str) or "\ue000" in m["content"]
                                 for m in messages):
            return self.tokenizer.render_chat(messages, add_generation_prompt=True)
        out = [pieces[0]]
        for m, piece in zip(messages, pieces[1:]):
            out.append(m["content"])
            out.append(piece)
        return "".join(out)


class SegmentEncoder:
    """Encode many prompts, encoding each distinct text segment between special tokens once.

    The `tokenizers` library cuts the input at added tokens before pre-tokenizing, so the ids
    of a text are the concatenation of the ids of its pieces; a system prompt shared by
    thousands of lines is then encoded once. Used only when no added token strips or is
    normalised and there is no normaliser (then the cut is exactly the library's); else, and
    for tokenizers without a `tokenizers` backend, every text is encoded whole."""

    MAX_CACHE = 200_000

    def __init__(self, tokenizer):  # noqa: ANN001
        import re

        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend", None)
        self.special: dict[str, int] = {}
        self.split = None
        self._cache: dict[str, list[int]] = {}
        if self.backend is None or not hasattr(self.backend, "get_added_tokens_decoder"):
            return
        added = self.backend.get_added_tokens_decoder()
        if self.backend.normalizer is not None or any(
                t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return
        self.special = {t.content: i for i, t in added.items()}
        alternatives = sorted(self.special, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")") if alternatives else None

    def _whole(self, texts: list[str]) -> list[list[int]]:
        if self.backend is not None and hasattr(self.backend, "encode_batch"):
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        if self.split is None:
            return self._whole(texts)
        if len(self._cache) > self.MAX_CACHE:
            self._cache.clear()
        parts = [self.split.split(t) for t in texts]
        todo = sorted({p for ps in parts for p in ps if p and p not in self.special and p not in self._cache})
        for seg, ids in zip(todo, self._whole(todo)):
            self._cache[seg] = ids
        out = []
        for ps in parts:
            ids: list[int] = []
            for p in ps:
                if not p:
                    continue
                if p in self.special:
                    ids.append(self.special[p])
                else:
                    ids.extend(self._cache[p])
            out.append(ids)
        return out


class ChatPromptEncoder:
    """``render(messages, tools)`` gives the prompt text (as ``render_chat(..., add_generation_prompt=True)``),
    ``encode_many(texts)`` its token ids without special tokens added: together, exactly
    ``apply_chat_template``. The renderer and the segment cache live as long as this object."""

    def __init__(self, tokenizer):  # noqa: ANN001
        self.renderer = ChatPromptRenderer(tokenizer)
        self.segments = SegmentEncoder(tokenizer)

    def render(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None) -> str:
        return self.renderer.render(messages, tools)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.segments.encode_many(texts)

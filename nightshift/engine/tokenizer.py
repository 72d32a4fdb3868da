"""Tokenizer + chat template, from GGUF metadata or a Hugging Face directory's tokenizer files.

GGUF (`tokenizer.ggml.model == "gpt2"`, byte-level BPE): the `tokenizers` BPE is rebuilt from
`tokenizer.ggml.tokens / merges / token_type` the way transformers does it (control tokens become
special added tokens, user-defined ones plain added tokens). HF directory: `tokenizer.json` plus
`tokenizer_config.json`. The chat template is the model's own (`tokenizer.chat_template`),
rendered with jinja2 under transformers' conventions (sandbox, trim_blocks, lstrip_blocks,
`raise_exception`, `tojson`, `strftime_now`, special tokens as variables) and tokenized without
adding special tokens. A GGUF's tokenizer is cached in its model cache entry (engine/model_files.py;
the loader writes it when it converts the GGUF), so `load_tokenizer("default")` reads two small files.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers, processors

from nightshift.engine.chat_prompts import ChatPromptEncoder
from nightshift.engine.gguf_file import GGUFFile
from nightshift.engine.model_files import atomic_write, cache_entry, resolve_model
from nightshift.engine.tool_formats import ToolSupport, tool_support

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"
_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp token types

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split regex; pre-tokenizers not listed use GPT-2's byte-level split
_PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                         "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_OF_CHAR = {char: byte for byte, char in _bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")    # SentencePiece byte fallback


class Tokenizer:
    """encode/decode and the model's chat template. `eos_token_ids`: ids that end a generation."""

    def __init__(self, backend: BackendTokenizer, chat_template: Optional[str], special_tokens: dict[str, Optional[str]],
                 eos_token_ids: list[int]):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = special_tokens        # bos_token, eos_token, unk_token, pad_token (text or None)
        self.eos_token_ids = list(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> Optional[int]:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.backend.token_to_id(bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (OpenAI's logprobs ``bytes``). Decoding a token that holds part
        of a multi-byte character on its own gives U+FFFD; its bytes keep the part, so the bytes
        of consecutive tokens join into the text. Added (special) tokens are their text."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level:
            if all(char in _BYTE_OF_CHAR for char in piece):
                return bytes(_BYTE_OF_CHAR[char] for char in piece)
            return piece.encode()
        byte = _BYTE_TOKEN.fullmatch(piece)
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @cached_property
    def _byte_level(self) -> bool:
        """GPT-2-style byte-level BPE (each byte spelled as one printable character), as opposed
        to SentencePiece's "\u2581" for spaces and <0xNN> byte tokens."""
        return type(self.backend.decoder).__name__ == "ByteLevel"

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat as text, by the model's own template."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of objects with 'role' and 'content'")
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **variables, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs) -> list[int]:
        """Prompt token ids for a chat (the template writes any BOS itself, so none is added)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)

    @cached_property
    def tool_support(self) -> ToolSupport:
        """What the chat template does with tools: its call format, whether it renders the
        ``tools`` list and assistant ``tool_calls`` (engine/tool_formats.py)."""
        return tool_support(self.chat_template)

    def chat_prompt_encoder(self) -> ChatPromptEncoder:
        """Renders and encodes many chat prompts fast, with the same ids as apply_chat_template."""
        return ChatPromptEncoder(self)

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def save(self, folder: Path) -> None:
        """tokenizer.json + tokenizer_meta.json (meta written last: its presence marks a complete save)."""
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / TOKENIZER_FILE, lambda tmp: self.backend.save(tmp))
        meta = {"chat_template": self.chat_template, "special_tokens": self.special_tokens,
                "eos_token_ids": self.eos_token_ids}
        atomic_write(folder / META_FILE, lambda tmp: Path(tmp).write_text(json.dumps(meta)))

    @classmethod
    def load(cls, folder: Path) -> "Tokenizer":
        meta = json.loads((folder / META_FILE).read_text())
        backend = BackendTokenizer.from_file(str(folder / TOKENIZER_FILE))
        return cls(backend, meta["chat_template"], meta["special_tokens"], meta["eos_token_ids"])


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                         "use the model's Hugging Face directory instead")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types = list(meta.get("tokenizer.ggml.token_type") or [])
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                          end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control tokens stay whole and count as special; a "control" token spelled outside the byte
    # alphabet is a llama.cpp mislabel and is skipped (as transformers does).
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(tokens, token_types) if kind == _CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab])

    def token(key: str) -> Optional[str]:
        index = meta.get(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[int(index)]

    special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
               "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    if meta.get("tokenizer.ggml.add_bos_token") and special["bos_token"] is not None:
        bos = special["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(backend, meta.get("tokenizer.chat_template"), special, [] if eos is None else [int(eos)])


def tokenizer_from_hf_dir(folder: Path) -> Tokenizer:
    if not (folder / TOKENIZER_FILE).exists():
        raise FileNotFoundError(f"{folder}: no tokenizer.json (only fast tokenizers are supported)")
    backend = BackendTokenizer.from_file(str(folder / TOKENIZER_FILE))
    cfg = _read_json(folder / "tokenizer_config.json")
    template = cfg.get("chat_template")
    if (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    def text(value) -> Optional[str]:
        return value.get("content") if isinstance(value, dict) else value

    special = {key: text(cfg.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    eos_ids: list[int] = []
    for source in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
        value = source.get("eos_token_id")
        if value is not None:
            eos_ids = [value] if isinstance(value, int) else list(value)
            break
    if not eos_ids and special["eos_token"] is not None:
        eos_ids = [backend.token_to_id(special["eos_token"])]
    return Tokenizer(backend, template, special, eos_ids)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def save_gguf_tokenizer(meta: dict[str, Any], entry: Path) -> Tokenizer:
    tokenizer = tokenizer_from_gguf_metadata(meta)
    tokenizer.save(entry)
    return tokenizer


def load_tokenizer(model: str = "default", cache_dir: Optional[str] = None) -> Tokenizer:
    """The tokenizer of `model` (see model_files.resolve_model), without loading any weights.
    `model` may also be a directory written by `Tokenizer.save` (e.g. a converted model's cache
    entry): a tokenizer shipped without its weights, as the dummy-weight benchmarks use it."""
    if (Path(model).expanduser() / META_FILE).exists():
        return Tokenizer.load(Path(model).expanduser())
    path = Path(resolve_model(model))
    if path.is_dir():
        return tokenizer_from_hf_dir(path)
    entry = cache_entry(str(path), cache_dir)
    if (entry / META_FILE).exists():
        return Tokenizer.load(entry)
    return save_gguf_tokenizer(GGUFFile(str(path)).metadata, entry)

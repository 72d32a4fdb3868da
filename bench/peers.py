"""The systems a CPU user would run instead of us, on bench.engine's workload and token ids.

Each peer is timed at several static batch sizes (one batch of that many requests each, greedy,
exactly `output_len` new tokens per request, EOS ignored) and reported per size as a
`PeerResult`; bench.engine compares our engine with the fastest.

* ``hf-float32``, ``hf-bfloat16``: transformers' ``generate`` (bench/engine.py runs those).
* ``ct2``: CTranslate2 (the ``bench`` extra installs it). The model is converted through
  transformers into a temporary folder (weights int8), then run as ``int8`` (int8 matmuls, float32
  elsewhere) and in its fastest other compute type on this CPU (``int8_bfloat16`` or
  ``bfloat16`` where it has bf16 kernels, else ``float32``).
* ``llamacpp``: llama.cpp through ``llama-cpp-python`` on the model's own GGUF file (in its own
  quantization), where that package is installed, batched as llama.cpp's own ``batched`` example
  and server batch: one context, a sequence id per request, one token per sequence per decode.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

PEERS = ("hf-float32", "hf-bfloat16", "ct2", "llamacpp")
# CTranslate2's other compute types on CPU, fastest first where the CPU has them ("int8" itself
# is int8_float32: int8 matmuls, float32 elsewhere)
CT2_OTHER_TYPES = ("int8_bfloat16", "bfloat16", "float32")


@dataclass
class PeerResult:
    system: str               # e.g. "HF bfloat16", "CTranslate2 int8"
    batch_size: int
    requests: int
    seconds: float
    output_tokens: int
    prompt_tokens: int

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds


def parse_peers(text: str) -> list[str]:
    """A comma list of PEERS (``hf`` stands for both HF dtypes), in order, without repeats."""
    chosen: list[str] = []
    for name in (part.strip() for part in text.split(",") if part.strip()):
        names = ["hf-float32", "hf-bfloat16"] if name == "hf" else [name]
        for one in names:
            if one not in PEERS:
                raise ValueError(f"unknown peer {one!r}; choose from hf, {', '.join(PEERS)}")
            if one not in chosen:
                chosen.append(one)
    return chosen


def available(peer: str) -> Optional[str]:
    """None where `peer` can run here, else why not (its package is missing)."""
    package = {"ct2": "ctranslate2", "llamacpp": "llama_cpp"}.get(peer)
    if package is not None and importlib.util.find_spec(package) is None:
        extra = ("pip install -e '.[bench]'" if peer == "ct2"
                 else "pip install llama-cpp-python: it builds llama.cpp, ~4 minutes on 2 cores")
        return f"{package} is not installed ({extra})"
    return None


def ct2_model(model: str, folder: Path) -> Path:
    """`model` converted for CTranslate2 (int8 weights) under `folder`, through transformers: the
    float32 weights our loader cached, saved as a transformers checkpoint with the tokenizer."""
    import ctranslate2.converters

    from bench.engine import hf_model_from_cache

    hf_dir, out_dir = folder / "transformers", folder / "ct2"
    hf_model_from_cache(model, torch.float32).save_pretrained(hf_dir)
    hf_tokenizer(model).save_pretrained(hf_dir)
    ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(out_dir), quantization="int8",
                                                                      force=True)
    return out_dir


@functools.cache
def converted(model: str) -> Path:
    """``ct2_model`` once per model and process, in a temporary folder removed at exit (a test
    session's fixtures and its bench.engine run share one conversion)."""
    folder = Path(tempfile.mkdtemp(prefix="nightshift-ct2-"))
    atexit.register(shutil.rmtree, folder, True)
    return ct2_model(model, folder)


def hf_tokenizer(model: str):
    """transformers' tokenizer of `model`: its folder's own, or, for a GGUF file, the
    tokenizer.json and special tokens our cache entry holds."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from nightshift.engine.model_files import cache_entry, resolve_model

    source = Path(resolve_model(model))
    if source.is_dir():
        return AutoTokenizer.from_pretrained(str(source))
    entry = cache_entry(str(source), None)
    special = json.loads((entry / "tokenizer_meta.json").read_text()).get("special_tokens", {})
    return PreTrainedTokenizerFast(tokenizer_file=str(entry / "tokenizer.json"), **special)


def token_text(model: str) -> Callable[[int], str]:
    """Token id -> its vocabulary string (CTranslate2 takes prompts as those)."""
    return hf_tokenizer(model).convert_ids_to_tokens


def ct2_compute_types() -> list[str]:
    """int8 and the fastest other compute type this CPU has (CTranslate2's own list)."""
    import ctranslate2

    supported = ctranslate2.get_supported_compute_types("cpu")
    other = next((t for t in CT2_OTHER_TYPES if t in supported), None)
    return ["int8"] + ([other] if other else [])


def _ct2_generate(model_dir: Path, compute_type: str, prompts: list[list[int]], output_len: int,
                  batch_size: int, threads: int, id_to_token: Callable[[int], str]) -> tuple[float, list[list[int]]]:
    """(seconds, each prompt's `output_len` greedy tokens with EOS suppressed) of one
    generate_batch call (the model load not timed)."""
    import ctranslate2

    generator = ctranslate2.Generator(str(model_dir), device="cpu", compute_type=compute_type,
                                      intra_threads=threads)
    tokens = [[id_to_token(i) for i in p] for p in prompts]
    start = time.time()
    results = generator.generate_batch(tokens, max_batch_size=batch_size, max_length=output_len,
                                       min_length=output_len, sampling_topk=1, include_prompt_in_result=False)
    return time.time() - start, [list(r.sequences_ids[0]) for r in results]


def run_ct2(model_dir: Path, compute_type: str, prompts: list[list[int]], output_len: int, batch_size: int,
            threads: int, id_to_token: Callable[[int], str]) -> tuple[float, int, int]:
    """One CTranslate2 run over `prompts` at `batch_size`: (seconds, output tokens, prompt tokens)."""
    seconds, outputs = _ct2_generate(model_dir, compute_type, prompts, output_len, batch_size, threads, id_to_token)
    return seconds, sum(len(o) for o in outputs), sum(len(p) for p in prompts)


def ct2_greedy(model_dir: Path, compute_type: str, prompt: list[int], output_len: int,
               id_to_token: Callable[[int], str]) -> list[int]:
    """CTranslate2's greedy continuation of one prompt (EOS suppressed), as token ids."""
    return _ct2_generate(model_dir, compute_type, [prompt], output_len, 1, 0, id_to_token)[1][0]


def ct2_results(model: str, prompts: list[list[int]], output_len: int, sizes: list[int], threads: int,
                id_to_token: Callable[[int], str], log=print) -> list[PeerResult]:
    """CTranslate2 in int8 and its fastest other compute type, at each batch size."""
    results = []
    started = time.time()
    model_dir = converted(model)
    log(f"the model for CTranslate2 (int8 weights) ready in {time.time() - started:.1f} s (converted once a process)")
    for compute_type in ct2_compute_types():
        for size in sizes:
            seconds, produced, prompt_tokens = run_ct2(model_dir, compute_type, prompts[:size], output_len,
                                                       size, threads, id_to_token)
            results.append(PeerResult(f"CTranslate2 {compute_type}", size, size, seconds, produced, prompt_tokens))
            log(describe(results[-1]))
    return results


def _quiet_llama_log(level, text, data):
    """llama.cpp's log callback: it logs every tensor at load; bench.engine prints what matters."""


_QUIET_LLAMA_LOG = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_quiet_llama_log)


def _llamacpp_generate(path: str, prompts: list[list[int]], output_len: int, batch_size: int,
                       threads: int) -> tuple[float, list[list[int]]]:
    """(seconds, each prompt's `output_len` greedy tokens, EOS not stopping it) of llama.cpp running
    `prompts` in batches of `batch_size` sequences, the way its own `batched` example and server
    do: each batch's prompts prefilled together in one context (a sequence id each, n_batch tokens
    a decode call), then one token per sequence per decode call. The model load is not timed."""
    import llama_cpp as lc
    import numpy as np

    lc.llama_log_set(_QUIET_LLAMA_LOG, None)
    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    # no extra buffer types: on an AMX Xeon, llama-cpp-python 0.3.36's AMX buffer for Q4_1 weights
    # segfaults at the first multi-token decode (its own Llama.generate too); without it llama.cpp
    # runs its AVX-512 / VNNI dot products (its weight repacking covers Q4_0, IQ4_NL and Q8_0)
    model_params.use_extra_bufts = False
    model = lc.llama_model_load_from_file(path.encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    longest = max(len(p) for p in prompts) + output_len
    params = lc.llama_context_default_params()
    params.n_ctx = -(-batch_size * longest // 256) * 256
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = batch_size
    params.n_threads = params.n_threads_batch = threads
    # a KV buffer per sequence (n_ctx shared out): llama.cpp's advice where sequences do not share
    # their cache; a unified buffer measured 65.7 / 56.7 / 36.8 output tok/s at batch 8 / 32 / 64
    # against 70.2 / 75.8 at 8 / 32 (Xeon with AMX, 2 cores)
    params.kv_unified = False
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError(f"llama.cpp could not make a context of {params.n_ctx} positions for {path}")
    batch = lc.llama_batch_init(max(params.n_batch, batch_size), 0, 1)

    def decode(items: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """items = (token, position, sequence, wants logits): the logits rows asked for, in order."""
        for i, (token, position, sequence, wants) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = sequence, wants
        batch.n_tokens = len(items)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = sum(1 for item in items if item[3])
        return np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(rows, n_vocab))

    outputs: list[list[int]] = []
    start = time.time()
    try:
        for first in range(0, len(prompts), batch_size):
            group = prompts[first:first + batch_size]
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            pending = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(group) for pos, t in enumerate(p)]
            last: list[int] = []
            for chunk in range(0, len(pending), params.n_batch):
                last += decode(pending[chunk:chunk + params.n_batch]).argmax(axis=1).tolist()
            made = [[token] for token in last]
            for step in range(1, output_len):
                nexts = decode([(m[-1], len(p) + step - 1, seq, True)
                                for seq, (p, m) in enumerate(zip(group, made))]).argmax(axis=1).tolist()
                for m, token in zip(made, nexts):
                    m.append(token)
            outputs += made
        return time.time() - start, outputs
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def llamacpp_path(model: str) -> str:
    """The model's GGUF file (llama.cpp runs nothing else)."""
    from nightshift.engine.model_files import resolve_model

    path = resolve_model(model)
    if Path(path).is_dir():
        raise ValueError("llama.cpp runs GGUF files; this model is a Hugging Face folder")
    return str(path)


def llamacpp_greedy(model: str, prompts: list[list[int]], output_len: int, batch_size: int,
                    threads: int) -> list[list[int]]:
    """llama.cpp's greedy continuations of `prompts` at `batch_size`, as token ids."""
    return _llamacpp_generate(llamacpp_path(model), prompts, output_len, batch_size, threads)[1]


def llamacpp_seconds(model: str, prompt: list[int], output_len: int, threads: int) -> float:
    """Seconds llama.cpp takes to prefill `prompt` and make `output_len` greedy tokens, alone (batch 1)."""
    return _llamacpp_generate(llamacpp_path(model), [prompt], output_len, 1, threads)[0]


def llamacpp_results(model: str, prompts: list[list[int]], output_len: int, sizes: list[int], threads: int,
                     log=print) -> list[PeerResult]:
    """llama.cpp on the model's own GGUF file (its quantization: Q4_1 for the default model, run as
    Q4_1 x Q8_1 dot products), at each batch size."""
    path = llamacpp_path(model)
    results = []
    for size in sizes:
        seconds, outputs = _llamacpp_generate(path, prompts[:size], output_len, size, threads)
        results.append(PeerResult("llama.cpp", size, size, seconds, sum(len(o) for o in outputs),
                                  sum(len(p) for p in prompts[:size])))
        log(describe(results[-1]))
    return results


def describe(result: PeerResult) -> str:
    return (f"{result.system:24s} batch {result.batch_size:3d}: {result.requests} requests in "
            f"{result.seconds:6.1f} s   output tok/s {result.output_tps:8.1f}   total tok/s "
            f"{(result.output_tokens + result.prompt_tokens) / result.seconds:8.1f}")

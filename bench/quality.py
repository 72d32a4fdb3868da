"""INT4 fidelity against full precision on the default model, and the CPU math paths against HF.

    python -m bench.quality [--model default] [--prompts 64] [--tokens 32] [--json out.json]
    python -m bench.quality --maths float32,bf16,int8 [--int4-kernels dense,w4a8]

With ``--maths``: each CPU math path of engine/layers/cpu_math.py (float32 weights, the engine's
loader) and HF transformers' own bfloat16 model, against HF transformers in float32, with the
measures below (``evaluate_maths``). Otherwise:

Full precision ("fp") is the checkpoint's float32 weights (for a GGUF file: its quantized
tensors dequantized exactly). The INT4 variants compared with it (``--variants``, default all):

* ``gguf-import``: GGUF Q4_0/Q4_1 blocks imported as they are (group 32). These are the same
  weights as fp, so differences come only from the kernels' arithmetic.
* ``rtn-g128``: round-to-nearest from the fp weights at group 128 (64 where a 576-wide row
  does not divide by 128) - a grid the GGUF weights were not on.
* ``awq-g128``, ``gptq-g128``, ``awq-gptq-g128``: the same grid, quantized with AWQ scaling,
  GPTQ or both (``QuantConfig.method``), calibrated on engine/quant/calibration.py's texts
  (none of them from this prompt set). Their first load calibrates (minutes), later ones hit
  the disk cache.

Each variant is loaded through the engine's loader (so quantized once, then from the disk
cache) and run with each of ``--kernels``: ``dense`` (the dequantized float32 weights, the CPU
path of steps of more than 8 rows), ``int4-kernel`` (the batch-1 engine path: the prefill dense,
every decode step on torch's int4 kernel with bfloat16 activations), ``int4-kernel-all``
(the kernel on the prefill too) and ``w4a8`` (every step on engine/quant/cpu_w4a8.py: int8
activations against the 4-bit weights). On a fixed set of chat prompts it reports:

* top-1 agreement and mean KL(fp || int4) of the next-token distribution at every position of
  fp's greedy continuation (teacher-forced, so both models see the same tokens);
* greedy exact match: the share of prompts whose greedy ``--tokens``-token continuation equals fp's.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from nightshift.engine.loader import load_model
from nightshift.engine.model_runner import ModelRunner
from nightshift.engine.quant import cpu_w8a8
from nightshift.engine.quant.config import QuantConfig
from nightshift.engine.quant.int4_linear import Int4Linear
from nightshift.engine.step import StepItem
from nightshift.engine.tokenizer import load_tokenizer

SUBJECTS = ("the moon", "photosynthesis", "the French Revolution", "a binary search tree",
            "coffee", "volcanoes", "the Python programming language", "honeybees")
TEMPLATES = (
    "What is {}? Answer in two sentences.",
    "Write a short poem about {}.",
    "Explain {} to a ten-year-old.",
    "Give me three interesting facts about {}.",
    "What are the pros and cons of {}?",
    "Summarize the history of {} in one paragraph.",
    "Write a haiku about {}.",
    "How would you teach a class about {}?",
)


def quality_prompts(count: int = 64) -> list[list[dict]]:
    """A fixed, deterministic set of chat prompts (8 templates x 8 subjects)."""
    prompts = [[{"role": "user", "content": t.format(s)}] for t in TEMPLATES for s in SUBJECTS]
    if count > len(prompts):
        raise ValueError(f"at most {len(prompts)} prompts are defined, asked for {count}")
    return prompts[:count]


@dataclass
class Comparison:
    variant: str
    kernel: str
    positions: int
    top1_agreement: float
    mean_kl: float
    greedy_exact_match: float
    seconds: float


def shared_blocks(prompts: list[list[int]], block_size: int) -> int:
    """Whole blocks of the prompts' common leading tokens, each prompt keeping one token after them."""
    common = 0
    while all(len(p) > common + 1 for p in prompts) and len({p[common] for p in prompts}) == 1:
        common += 1
    return common // block_size


class _Stepper:
    """Runs a model over many sequences at once through ModelRunner, one token per step. With
    ``share_prefix`` the whole blocks of the prompts' common start are one set of blocks, computed
    once and then read by every sequence, as the engine's prefix cache serves them."""

    def __init__(self, model, prompts: list[list[int]], new_tokens: int, block_size: int = 16,
                 after_prefill=None, before_prefill=None, share_prefix: bool = False):
        self.prompts = prompts
        self.after_prefill = after_prefill or (lambda: None)
        self.before_prefill = before_prefill or (lambda: None)
        shared = shared_blocks(prompts, block_size) if share_prefix else 0
        self.shared = shared * block_size
        blocks_each = [math.ceil((len(p) + new_tokens) / block_size) - shared for p in prompts]
        self.runner = ModelRunner(model, num_kv_blocks=shared + sum(blocks_each), block_size=block_size)
        starts = [shared + sum(blocks_each[:i]) for i in range(len(prompts))]
        self.tables = [list(range(shared)) + list(range(s, s + n)) for s, n in zip(starts, blocks_each)]

    def run(self, new_tokens: int, forced: list[list[int]] | None = None):
        """Greedy continuation (or ``forced`` tokens fed instead); returns (tokens, log-probs
        [steps, sequences, vocab] of every step's next-token distribution)."""
        if self.shared:
            self.runner.execute([StepItem(self.prompts[0][:self.shared], 0, self.tables[0])])
        items = [StepItem(p[self.shared:], self.shared, t) for p, t in zip(self.prompts, self.tables)]
        logprobs, tokens = [], [[] for _ in self.prompts]
        for step in range(new_tokens):
            (self.after_prefill if step else self.before_prefill)()
            lp = F.log_softmax(self.runner.execute(items).float(), dim=-1)
            logprobs.append(lp)
            chosen = lp.argmax(-1).tolist() if forced is None else [f[step] for f in forced]
            for i, tok in enumerate(chosen):
                tokens[i].append(tok)
            items = [StepItem([tok], len(p) + step, t) for tok, p, t in zip(chosen, self.prompts, self.tables)]
        return tokens, torch.stack(logprobs)


def _load(model: str, quant_config, cache_dir):
    return load_model(model, dtype=torch.float32, quant_config=quant_config, cache_dir=cache_dir)


def _set_int4_max_rows(model, rows: int) -> None:
    """The INT4 layers' small-step bound, and the LM head's that follows it (layers/q8_head.py)."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.cpu_int4_max_rows = rows
    if model.q8_head is not None:
        model.q8_head_rows = rows


# Int4Linear.cpu_int4_max_rows for (the prefill step, the decode steps): "dense" forces the
# dense path, "int4-kernel" is what the engine runs at batch 1 (the prefill of a prompt longer
# than 8 tokens dense, every decode step on the int4 kernel), "int4-kernel-all" forces the
# kernel on the prefill too.
KERNEL_ROWS = {"dense": (0, 0), "int4-kernel": (0, 1 << 30), "int4-kernel-all": (1 << 30, 1 << 30),
               "w4a8": (0, 0)}


def _set_int4_kernel(model, kernel: str) -> None:
    """"w4a8": every INT4 layer's CPU steps on the W4A8 kernel (engine/quant/cpu_w4a8.py), else
    the dense kernels (tinygemm / dequantized, by KERNEL_ROWS)."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.cpu_kernel = "w4a8" if kernel == "w4a8" else "dense"
    # the LM head follows, as the engine builds it (layers/q8_head.py): int8 activations with W4A8
    model.q8_head_int8 = kernel == "w4a8" and model.q8_head is not None and cpu_w8a8.available()


def quantized_layer_bytes(model) -> tuple[int, int]:
    """(bytes of the INT4 layers as stored, bytes of the same weights in bfloat16)."""
    stored = dense = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            stored += module.int4_weight.nbytes()
            dense += module.in_features * module.out_features * 2
    return stored, dense


def evaluate(model: str = "default", num_prompts: int = 64, new_tokens: int = 32,
             cache_dir: str | None = None,
             variants: tuple[str, ...] | None = None, kernels: tuple[str, ...] = ("dense", "int4-kernel"),
             log=print) -> dict:
    configs = {"gguf-import": QuantConfig(),
               "rtn-g128": QuantConfig(group_size=128, import_gguf_blocks=False),
               "awq-g128": QuantConfig(group_size=128, import_gguf_blocks=False, method="awq"),
               "gptq-g128": QuantConfig(group_size=128, import_gguf_blocks=False, method="gptq"),
               "awq-gptq-g128": QuantConfig(group_size=128, import_gguf_blocks=False, method="awq-gptq")}
    unknown = set(variants or ()) - set(configs)
    if unknown:
        raise ValueError(f"unknown variant(s) {sorted(unknown)}; choose from {sorted(configs)}")
    unknown = set(kernels) - set(KERNEL_ROWS)
    if unknown:
        raise ValueError(f"unknown kernel(s) {sorted(unknown)}; choose from {sorted(KERNEL_ROWS)}")
    tokenizer = load_tokenizer(model, cache_dir=cache_dir)
    prompts = [tokenizer.apply_chat_template(m) for m in quality_prompts(num_prompts)]
    start = time.perf_counter()
    # the reference and every INT4 model run the torch layers (not the fused bf16 CPU layers and
    # their bfloat16 K/V pool) and the same LM head (the math's own: an INT4 model's larger steps'
    # head), so that only the weights differ between them
    fp_model = load_model(model, dtype=torch.float32, cache_dir=cache_dir, cpu_head="dense")
    fp_model.fused_layers = None
    fp_tokens, fp_logprobs = _Stepper(fp_model, prompts, new_tokens).run(new_tokens)
    log(f"fp: {len(prompts)} prompts x {new_tokens} tokens in {time.perf_counter() - start:.1f}s")

    results, sizes = [], {}
    for variant, config in configs.items():
        if variants and variant not in variants:
            continue
        t0 = time.perf_counter()
        int4_model = _load(model, config, cache_dir)
        int4_model.fused_layers = None
        log(f"{variant}: loaded in {time.perf_counter() - t0:.1f}s")
        stored, dense = quantized_layer_bytes(int4_model)
        groups = sorted({m.group_size for m in int4_model.modules() if isinstance(m, Int4Linear)})
        sizes[variant] = {"int4_bytes": stored, "bf16_bytes": dense, "ratio_vs_bf16": dense / stored,
                          "ratio_vs_fp32": 2 * dense / stored, "group_sizes": groups}
        for kernel in kernels:
            prefill_rows, decode_rows = KERNEL_ROWS[kernel]
            _set_int4_kernel(int4_model, kernel)
            t0 = time.perf_counter()
            stepper = _Stepper(int4_model, prompts, new_tokens,
                               before_prefill=lambda: _set_int4_max_rows(int4_model, prefill_rows),
                               after_prefill=lambda: _set_int4_max_rows(int4_model, decode_rows))
            _, forced_lp = stepper.run(new_tokens, forced=fp_tokens)
            greedy_tokens, _ = stepper.run(new_tokens)
            top1 = (forced_lp.argmax(-1) == fp_logprobs.argmax(-1)).float().mean().item()
            kl = (fp_logprobs.exp() * (fp_logprobs - forced_lp)).sum(-1).mean().item()
            exact = sum(a == b for a, b in zip(greedy_tokens, fp_tokens)) / len(prompts)
            result = Comparison(variant, kernel, fp_logprobs.shape[0] * fp_logprobs.shape[1],
                                top1, kl, exact, time.perf_counter() - t0)
            results.append(result)
            log(f"{variant:13s} {kernel:12s} top1={top1:.4f} KL={kl:.2e} greedy_exact={exact:.3f} "
                f"({result.seconds:.1f}s)")
    return {"model": model, "prompts": len(prompts), "new_tokens": new_tokens,
            "comparisons": [asdict(r) for r in results], "checkpoint_sizes": sizes}


def hf_teacher_forced(hf, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    """transformers' next-token log-probs [steps, prompts, vocab] along `forced` continuations
    (one unpadded forward per prompt, as our stepper's positions)."""
    rows = []
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, forced):
            ids = torch.tensor([prompt + tokens[:-1]])
            logits = hf(ids).logits[0, len(prompt) - 1:].float()
            rows.append(F.log_softmax(logits, dim=-1))
    return torch.stack(rows, dim=1)


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations, one prompt at a time (no padding), EOS ignored."""
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


def evaluate_maths(model: str = "default", num_prompts: int = 64, new_tokens: int = 32,
                   maths: tuple[str, ...] = ("float32", "bf16", "int8"), cache_dir: str | None = None,
                   int4_kernels: tuple[str, ...] = (), shared_system: bool = False, log=print) -> dict:
    """Each CPU math path of our engine (engine/layers/cpu_math.py) and HF's own bfloat16 against
    HF transformers in float32 on the same prompts: top-1 agreement and mean KL(HF fp32 || path)
    along HF float32's greedy continuation (teacher-forced), and the share of prompts whose
    greedy continuation equals HF float32's. The rule for a default path: no more drift than
    HF bf16 shows here. `int4_kernels` (dense, w4a8): the engine's default INT4 model (its
    QuantConfig: a GGUF's Q4 blocks imported as they are) on this CPU's chosen math with each of
    these kernels for its INT4 layers (cpu_math.choose_int4). `shared_system`: every chat opens
    with bench.engine's ~200-token system prompt, whose blocks all sequences share (computed once),
    so a step's rows attend a shared prefix as in the standard workload (on an AMX CPU, on its
    tiles: engine/kernels/cpu_prefix_attention.py)."""
    from bench.engine import hf_model_from_cache, system_prompt

    tokenizer = load_tokenizer(model, cache_dir=cache_dir)
    opening = [{"role": "system", "content": system_prompt(tokenizer)}] if shared_system else []
    prompts = [tokenizer.apply_chat_template(opening + m) for m in quality_prompts(num_prompts)]
    start = time.perf_counter()
    hf32 = hf_model_from_cache(model, torch.float32)
    ref_tokens = hf_greedy(hf32, prompts, new_tokens)
    ref_logprobs = hf_teacher_forced(hf32, prompts, ref_tokens)
    del hf32
    log(f"HF float32: {len(prompts)} prompts x {new_tokens} tokens in {time.perf_counter() - start:.1f}s")

    def compare(name: str, logprobs: torch.Tensor, greedy: list[list[int]], seconds: float) -> Comparison:
        top1 = (logprobs.argmax(-1) == ref_logprobs.argmax(-1)).float().mean().item()
        kl = (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1).mean().item()
        exact = sum(a == b for a, b in zip(greedy, ref_tokens)) / len(prompts)
        log(f"{name:22s} top1={top1:.4f} KL={kl:.2e} greedy_exact={exact:.3f} ({seconds:.1f}s)")
        return Comparison(name, "hf-float32", ref_logprobs.shape[0] * ref_logprobs.shape[1], top1, kl, exact,
                          seconds)

    results = []
    t0 = time.perf_counter()
    hf16 = hf_model_from_cache(model, torch.bfloat16)
    results.append(compare("HF bfloat16", hf_teacher_forced(hf16, prompts, ref_tokens),
                           hf_greedy(hf16, prompts, new_tokens), time.perf_counter() - t0))
    del hf16
    def ours(name: str, **load_args) -> Comparison:
        """Our engine's model loaded with `load_args`, teacher-forced and greedy."""
        t0 = time.perf_counter()
        net = load_model(model, dtype=torch.float32, cache_dir=cache_dir, **load_args)
        stepper = _Stepper(net, prompts, new_tokens, share_prefix=shared_system)
        _, forced_lp = stepper.run(new_tokens, forced=ref_tokens)
        greedy, _ = stepper.run(new_tokens)
        return compare(name.format(math=net.cpu_math.math), forced_lp, greedy, time.perf_counter() - t0)

    results += [ours(f"nightshift {math}", cpu_math=math) for math in maths]
    results += [ours(f"nightshift int4 {kernel} ({{math}})", quant_config=QuantConfig(), cpu_int4=kernel)
                for kernel in int4_kernels]
    return {"model": model, "prompts": len(prompts), "new_tokens": new_tokens, "reference": "HF float32",
            "shared_system": shared_system, "comparisons": [asdict(r) for r in results]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="INT4 vs full-precision fidelity on a fixed prompt set")
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--variants", default=None, help="comma list (default: all)")
    ap.add_argument("--kernels", default="dense,int4-kernel", help=f"comma list of {','.join(KERNEL_ROWS)}")
    ap.add_argument("--json", default=None, help="also write the report to this file")
    ap.add_argument("--maths", default=None,
                    help="instead of the INT4 variants: these CPU math paths (comma list of float32,bf16,int8) "
                         "and HF bfloat16, each against HF float32")
    ap.add_argument("--int4-kernels", default=None,
                    help="with --maths: also the engine's default INT4 model with each of these CPU kernels for "
                         "its INT4 layers (comma list of dense,w4a8)")
    ap.add_argument("--shared-system", action="store_true",
                    help="with --maths: every chat opens with bench.engine's ~200-token system prompt, its blocks "
                         "shared by all sequences (the standard workload's shared prefix)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.maths:
        report = evaluate_maths(args.model, args.prompts, args.tokens, tuple(args.maths.split(",")), args.cache_dir,
                                int4_kernels=tuple(args.int4_kernels.split(",")) if args.int4_kernels else (),
                                shared_system=args.shared_system)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=1)
        return
    report = evaluate(args.model, args.prompts, args.tokens, args.cache_dir,
                      variants=tuple(args.variants.split(",")) if args.variants else None,
                      kernels=tuple(args.kernels.split(",")))
    for variant, size in report["checkpoint_sizes"].items():
        print(f"{variant:13s} quantized layers: {size['int4_bytes'] / 2**20:.1f} MiB INT4 vs "
              f"{size['bf16_bytes'] / 2**20:.1f} MiB bf16 ({size['ratio_vs_bf16']:.2f}x smaller; "
              f"{size['ratio_vs_fp32']:.2f}x vs fp32), groups {size['group_sizes']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()

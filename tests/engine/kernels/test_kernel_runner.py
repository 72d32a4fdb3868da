"""ModelRunner with the Triton attention backend against the torch backend, step by step on the
same model: fresh prompts, a prefix shared by several sequences, chunked prefill after cached
tokens, and mixed decode + prefill steps. (CPU: the kernels in Triton's interpreter; CUDA: compiled.)"""
import pytest
import torch

from kernel_cases import use_interpreter_without_cuda

DEVICE = use_interpreter_without_cuda()

from bench.dummy_weights import build_dummy_model  # noqa: E402
from nightshift.engine.attention import TorchAttention  # noqa: E402
from nightshift.engine.attention.triton_backend import TritonAttention  # noqa: E402
from nightshift.engine.kernels import gpu_fused_ops  # noqa: E402
from nightshift.engine.models import fused_gpu_layer  # noqa: E402
from nightshift.engine.models.llama import plain_layer  # noqa: E402
from nightshift.engine.model_runner import ModelRunner, StepItem  # noqa: E402


@pytest.fixture(scope="module")
def runners():
    model = build_dummy_model("llama-tiny", dtype=torch.float32, device=DEVICE, seed=3)
    return (ModelRunner(model, num_kv_blocks=24, block_size=4, attention_backend="torch"),
            ModelRunner(model, num_kv_blocks=24, block_size=4, attention_backend="triton", enforce_eager=True))


def mixed_steps() -> list[list[StepItem]]:
    """Fresh prompts, a shared prefix, chunked prefill after cached tokens, mixed decode + prefill."""
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(0, 49152, (n,), generator=g).tolist()

    shared = tokens(8)                                   # two full blocks shared by sequences a and b
    a, b, c = tokens(3), tokens(5), tokens(9)
    return [
        # fresh prompts; c is prefilled in two chunks
        [StepItem(shared + a, 0, [0, 1, 2]), StepItem(c[:5], 0, [6, 7, 8])],
        # b reuses the shared blocks (prefix-cache hit), c's second chunk after 5 cached tokens, a decodes
        [StepItem(tokens(1), 11, [0, 1, 2]), StepItem(b, 8, [0, 1, 3, 4]), StepItem(c[5:], 5, [6, 7, 8]),],
        # decode everything, c's context crossing into a new block
        [StepItem(tokens(1), 12, [0, 1, 2, 5]), StepItem(tokens(1), 13, [0, 1, 3, 4]),
         StepItem(tokens(1), 9, [6, 7, 8]), ],
        [StepItem(tokens(1), 13, [0, 1, 2, 5]), StepItem(tokens(1), 14, [0, 1, 3, 4]),
         StepItem(tokens(1), 10, [6, 7, 8]), StepItem(tokens(2), 0, [9], need_logits=False)],
    ]


def test_backend_choice_is_validated():
    model = build_dummy_model("llama-tiny", device="meta", max_position_embeddings=64)
    with pytest.raises(ValueError, match="attention_backend must be 'auto', 'torch' or 'triton', got 'cuda'"):
        ModelRunner(model, num_kv_blocks=2, attention_backend="cuda")
    assert type(ModelRunner(model, num_kv_blocks=2).attention) is TorchAttention    # auto on a non-CUDA device
    assert isinstance(ModelRunner(model, num_kv_blocks=2, attention_backend="triton").attention, TritonAttention)


def test_kernel_path_gives_the_torch_path_logits(runners, monkeypatch):
    torch_runner, kernel_runner = runners
    assert isinstance(kernel_runner.attention, TritonAttention)
    calls = []
    kernel_forward = TritonAttention.forward
    monkeypatch.setattr(TritonAttention, "forward", lambda self, *a: calls.append(a[5]) or kernel_forward(self, *a))
    steps = mixed_steps()
    for number, items in enumerate(steps):
        expected = torch_runner.execute(items)
        got = kernel_runner.execute(items)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < 1e-4, f"step {number}"
    layers = kernel_runner.config.num_layers
    assert len(calls) == layers * len(steps)              # every layer of every step on the kernels
    assert [m.num_decode for m in calls[::layers]] == [0, 1, 3, 3]


def test_fused_gpu_layers_give_the_torch_path_logits(runners, monkeypatch):
    """The layers with their small ops as Triton kernels (models/fused_gpu_layer.py; built by the
    model itself on CUDA, by hand here on CPU) over the same mixed steps."""
    torch_runner, kernel_runner = runners
    model = kernel_runner.model
    used = []
    ops = type("CountingOps", (), {name: staticmethod(lambda *a, _f=getattr(gpu_fused_ops, name), _n=name:
                                                     used.append(_n) or _f(*a))
                                   for name in ("add_rms_norm", "rope_", "silu_mul")})
    monkeypatch.setattr(model, "fused_gpu_layers", [fused_gpu_layer.FusedGpuLayer(layer, ops) for layer in model.layers])
    for number, items in enumerate(mixed_steps()):
        expected = torch_runner.execute(items)
        got = kernel_runner.execute(items)
        assert (got - expected).abs().max().item() < 1e-4, f"step {number}"
    assert used.count("silu_mul") == model.config.num_layers * 4 and used.count("add_rms_norm") == 2 * used.count("rope_")


def test_fused_gpu_layers_are_built_on_cuda_only(monkeypatch):
    model = build_dummy_model("llama-tiny", dtype=torch.float32, device=DEVICE, seed=3)
    if DEVICE == "cuda":
        assert model.fused_gpu_layers is not None and len(model.fused_gpu_layers) == model.config.num_layers
        monkeypatch.setenv(fused_gpu_layer.ENV, "0")
        assert fused_gpu_layer.build(model, plain_layer) is None
        monkeypatch.delenv(fused_gpu_layer.ENV)
        assert fused_gpu_layer.build(model, lambda layer: False) is None    # any other layer shape: torch layers
    else:
        assert model.fused_gpu_layers is None and fused_gpu_layer.build(model, plain_layer) is None

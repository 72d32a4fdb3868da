"""The service passes the engine only the knobs its settings set; unset ones keep the
engine's own defaults."""
from nightshift.settings import Settings
from nightshift.workers.engine_host import engine_options


def test_unset_engine_knobs_are_not_passed(monkeypatch):
    for key in ("QUANTIZATION", "DEVICE", "ENGINE_MAX_NUM_SEQS", "ENGINE_MAX_NUM_BATCHED_TOKENS",
                "ENGINE_NUM_KV_BLOCKS"):
        monkeypatch.delenv(f"NIGHTSHIFT_{key}", raising=False)
    assert engine_options(Settings()) == {}
    assert engine_options(Settings(engine_max_num_batched_tokens=2048, quantization="none", device="cpu")) == {
        "max_num_batched_tokens": 2048, "quantization": "none", "device": "cpu"}

"""The embedding engine's parts: step planning, attention layouts, pooling modes, model folders."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from nightshift.engine.embeddings import EmbeddingEngine, read_model_files, resolve_embedding_model
from nightshift.engine.embeddings.batching import plan_steps
from nightshift.engine.embeddings.bert import EncoderConfig
from nightshift.engine.embeddings.pooling import PoolingConfig, pool
from nightshift.engine.embeddings.varlen import ATTENTION, VarlenBatch

TEXTS = ["hello", "a somewhat longer sentence about rivers and bridges", "東京都の天気は晴れです", "word " * 300]


def test_steps_are_length_sorted_and_within_the_budget():
    lengths = [5, 100, 7, 60, 300, 8, 61, 2, 2, 2]
    steps = plan_steps(lengths, max_tokens=200, max_seqs=3)
    assert sorted(i for step in steps for i in step) == list(range(len(lengths)))
    flat = [lengths[i] for step in steps for i in step]
    assert flat == sorted(lengths, reverse=True)
    assert steps[0] == [4]                                      # longer than the budget: a step of its own
    for step in steps[1:]:
        assert len(step) <= 3 and len(step) * max(lengths[i] for i in step) <= 200


def test_a_step_knows_its_runs_of_equal_lengths():
    batch = VarlenBatch.build([7, 3, 3, 1, 12, 12])
    assert batch.groups == [(0, 1, 7), (7, 2, 3), (13, 1, 1), (14, 2, 12)]
    assert batch.positions.tolist()[:9] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert batch.cu_seqlens.tolist() == [0, 7, 10, 13, 14, 26, 38]


@pytest.mark.parametrize("name", ["padded", "per_sequence"])
def test_attention_layouts_agree(name):
    torch.manual_seed(0)
    lengths = [7, 3, 3, 1, 12, 12]
    batch = VarlenBatch.build(lengths)
    qkv = torch.randn(sum(lengths), 3 * 32)
    expected = ATTENTION["grouped"](qkv, batch, num_heads=4)
    torch.testing.assert_close(ATTENTION[name](qkv, batch, num_heads=4), expected, atol=1e-5, rtol=1e-5)
    # each sequence attends to itself only: alone it gives the same rows
    for start, end in ((0, 7), (7, 10), (14, 26)):
        alone = ATTENTION["grouped"](qkv[start:end], VarlenBatch.build([end - start]), 4)
        torch.testing.assert_close(alone, expected[start:end], atol=1e-5, rtol=1e-5)


def test_pooling_modes_on_the_packed_layout():
    torch.manual_seed(0)
    lengths = [3, 1, 4]
    hidden = torch.randn(sum(lengths), 5)
    cu = torch.tensor([0, 3, 4, 8])
    seqs = [hidden[0:3], hidden[3:4], hidden[4:8]]
    expected = {"cls": [s[0] for s in seqs], "max": [s.max(0).values for s in seqs],
                "mean": [s.mean(0) for s in seqs], "mean_sqrt_len_tokens": [s.sum(0) / len(s) ** 0.5 for s in seqs],
                "lasttoken": [s[-1] for s in seqs]}
    for mode, rows in expected.items():
        torch.testing.assert_close(pool(hidden, cu, PoolingConfig(5, (mode,))), torch.stack(rows))
    both = pool(hidden, cu, PoolingConfig.from_st_config({"pooling_mode_cls_token": True,
                                                          "pooling_mode_mean_tokens": True}, 5))
    torch.testing.assert_close(both, torch.cat([torch.stack(expected["cls"]), torch.stack(expected["mean"])], 1))
    with pytest.raises(ValueError, match="weightedmean"):
        PoolingConfig.from_st_config({"pooling_mode_weightedmean_tokens": True}, 5)


def _model_copy(tmp_path, pooling: dict | None, modules: list[str] | None):
    """The default model's folder, with its pooling config and module list replaced."""
    source = resolve_embedding_model("default")
    folder = tmp_path / "variant"
    shutil.copytree(source, folder)
    if modules is None:
        (folder / "modules.json").unlink()
        (folder / "sentence_bert_config.json").unlink()
    else:
        entries = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
                   for i, (kind, path) in enumerate([(m, {"Pooling": "1_Pooling"}.get(m, "")) for m in modules])]
        (folder / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384, **pooling}))
    return folder


@pytest.mark.parametrize("pooling, modules", [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, ["Transformer", "Pooling"]),
    ({"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}, ["Transformer", "Pooling", "Normalize"]),
])
def test_other_pooling_configs_match_sentence_transformers(tmp_path, pooling, modules):
    from sentence_transformers import SentenceTransformer
    folder = _model_copy(tmp_path, pooling, modules)
    engine = EmbeddingEngine.from_pretrained(str(folder), dtype="float32")     # the norms to 1e-3
    assert engine.normalized == ("Normalize" in modules)
    ours = engine.embed(TEXTS)
    reference = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    cosine = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosine.min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(reference, axis=1), rtol=1e-3)


def test_a_plain_hugging_face_folder_is_read_as_sentence_transformers_reads_it(tmp_path):
    files = read_model_files(str(_model_copy(tmp_path, None, None)))
    assert files.pooling.modes == ("mean",) and not files.normalize and files.max_seq_length is None
    engine = EmbeddingEngine.from_pretrained(str(files.path))
    assert engine.max_seq_length == 512   # tokenizer_config's model_max_length, within the position table


def test_unsupported_folders_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="Dense"):
        read_model_files(str(_model_copy(tmp_path, None, ["Transformer", "Pooling", "Dense"])))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        resolve_embedding_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not supported"):
        EncoderConfig.from_dict({"model_type": "gpt2"})

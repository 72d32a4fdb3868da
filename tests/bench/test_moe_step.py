"""python -m bench.moe_step: the engine's MoE layer against a dense MLP of the same active width."""
from __future__ import annotations

import pytest
import torch

from bench.moe_step import SHAPES, build_pair, parse_args, run
from nightshift.engine.models.llama import MLP
from nightshift.engine.models.moe import SparseMoeBlock


def params(module: torch.nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in module.modules() if hasattr(m, "in_features"))


def test_dense_side_has_the_active_parameters_of_the_moe_side():
    shape = SHAPES["tiny"]
    moe, dense = build_pair(shape)
    assert isinstance(moe, SparseMoeBlock) and type(dense) is MLP and moe.shared_expert is not None
    per_expert = params(moe.experts[0])
    assert params(dense) == shape.top_k * per_expert + params(moe.shared_expert)
    assert dense.intermediate == shape.top_k * shape.expert_intermediate + shape.shared_intermediate
    x = torch.randn(5, shape.hidden)
    assert moe(x).shape == dense(x).shape == x.shape


def test_command_prints_a_row_per_token_count():
    lines = []
    report = run(parse_args(["--shapes", "tiny", "--tokens", "1,8", "--repeats", "1"]), log=lines.append)
    rows = report["tiny"]
    assert [m.tokens for m in rows] == [1, 8]
    assert all(m.moe_seconds > 0 and m.dense_seconds > 0 for m in rows)
    assert rows[0].experts_used == SHAPES["tiny"].top_k and 2 <= rows[1].experts_used <= SHAPES["tiny"].experts
    assert len(lines) == 2 + 2 and "dense MLP of 96" in lines[0] and lines[-1].split()[0] == "8"


def test_unknown_shape_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--shapes", "nope"])

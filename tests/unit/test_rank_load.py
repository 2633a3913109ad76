"""A rank loads the model in the dtype it trains in: a bf16 DeepSpeed run's ZeRO-0/1/2
ranks each held an fp32 copy in host memory first (twice the bytes, per rank)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def test_rank_loads_model_in_training_dtype(tmp_path: Path):
    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model
    from stages.lib.distributed.rank import load_model

    tiny = TinyModel(hidden_size=32, num_layers=1, num_heads=2, vocab_size=300)
    build_tiny_model(tiny, [f"{a} + {a} = {2 * a}" for a in range(30)], str(tmp_path / "m"), 0)
    for bf16, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        ds = {"bf16": {"enabled": bf16}, "zero_optimization": {"stage": 2}}
        model = load_model(str(tmp_path / "m"), ds)
        assert {p.dtype for p in model.parameters()} == {dtype}
    # the torch trainer (no ds_config): fp32 weights, bf16 by autocast
    assert {p.dtype for p in load_model(str(tmp_path / "m"), None).parameters()} == {torch.float32}

"""The rl actor's passes go through the model's top-level forward (`tests.forward_rank`):
the same log-probabilities as calling the decoder and the head directly, and ZeRO-3's trace,
which starts at the root module's forward hook (the prefetching it drives never ran on the
old path), is recorded."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster import run_rank

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def forward_rank(device: str, *extra: str) -> dict[str, Any]:
    return run_rank("tests.forward_rank", device, device, *extra)


def test_actor_forward_runs_zero3_hooks_with_equal_logprobs():
    pytest.importorskip("deepspeed")
    result = forward_rank("cpu")
    assert result["max_diff"] < 1e-5
    assert result["traces"][-1] is True  # ZeRO-3 recorded the module trace
    old = forward_rank("cpu", "direct")
    assert old["traces"] == [False, False, False]  # the old path never completed one


@pytest.mark.gpu
def test_actor_forward_runs_zero3_hooks_on_cuda():
    result = forward_rank("cuda")
    assert result["max_diff"] < 1e-4
    assert result["traces"][-1] is True

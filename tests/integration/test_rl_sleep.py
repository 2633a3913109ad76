"""The hybrid engine's trainer sleep on a real DeepSpeed engine: every optimizer tensor off
its place while asleep, and the next step the one it would have been (`tests.sleep_rank`).
On the CPU the GPU's methods move states between two places in host memory; on CUDA
(marked `gpu`) the device memory drops and comes back."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster import run_rank

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def sleep_rank(zero: int, bf16: bool, device: str) -> dict[str, Any]:
    return run_rank("tests.sleep_rank", device, str(zero), str(int(bf16)), device)


@pytest.mark.parametrize(
    ("zero", "bf16", "method"),
    [(0, False, "trainer"), (0, True, "trainer"), (2, True, "deepspeed"), (3, False, "zero3")],
)
def test_every_optimizer_tensor_leaves_and_the_next_step_is_unchanged_cpu(
    zero: int, bf16: bool, method: str
):
    result = sleep_rank(zero, bf16, "cpu")
    assert result["method"] == method
    assert result["watched"] and result["away"] == result["watched"]
    masters = [k for k in result["watched"] if k.startswith("master")]
    assert bool(masters) == (bf16 or zero > 0)  # fp32 ZeRO-0 steps the weights themselves
    assert result["identical"]


@pytest.mark.gpu
@pytest.mark.parametrize(("zero", "method"), [(0, "trainer"), (3, "zero3")])
def test_the_states_leave_the_gpu_and_come_back_before_the_next_step(zero: int, method: str):
    result = sleep_rank(zero, True, "cuda")
    assert result["method"] == method
    before, asleep, awake = result["memory"]
    assert asleep < before and awake > asleep
    assert result["away"] == result["watched"]
    assert result["identical"]

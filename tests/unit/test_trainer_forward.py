"""The torch trainer's bf16 autocast applies to the rl actor's passes (they go through the
trainer's call, the model's top-level forward): settings.json says bf16 applied, and before
this the actor called the decoder and head itself, outside the autocast."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_torch_trainer_bf16_autocast_applies_to_actor_logprobs():
    from stages.lib.distributed.trainer import TorchTrainer
    from stages.rl.algo.logprobs import Sample, completion_logprobs
    from tests.sleep_rank import Settings, tiny

    samples = [Sample(ids=(1, 5, 9, 2, 7, 3, 11, 4), prompt_len=3)]
    plain = TorchTrainer(tiny(), Settings(0, False), 10, "cpu")
    bf16 = TorchTrainer(tiny(), Settings(0, True), 10, "cpu")
    ids = torch.tensor([samples[0].ids])
    assert plain(input_ids=ids).logits.dtype == torch.float32
    assert bf16(input_ids=ids).logits.dtype == torch.bfloat16
    with torch.no_grad():
        full = completion_logprobs(bf16.module, samples, "cpu", 1.0, 0)[0][0]
        auto = completion_logprobs(bf16.module, samples, "cpu", 1.0, 0, call=bf16)[0][0]
    # the same weights, computed in bf16: close, and not the fp32 numbers
    assert torch.allclose(full, auto, atol=5e-2)
    assert not torch.equal(full, auto)

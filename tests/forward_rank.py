"""One DeepSpeed ZeRO-3 rank for the tests: `python -m tests.forward_rank DEVICE [direct]`
prints one JSON line.

The rl actor's log-probabilities through the model's top-level forward (DeepSpeed's engine:
`stages.rl.algo.logprobs.completion_logprobs` with `call=trainer`) beside the old path (the
decoder and the output head called directly, bypassing the root module). Output: the
largest difference between the two, and after each of three optimizer steps whether ZeRO-3's
parameter coordinator holds a complete trace (recorded at the root module's forward hook:
what prefetching runs from). With `direct`, the steps go through the old path instead.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from tests.sleep_rank import Settings, tiny


def direct(module: Any, samples: list[Any], device: str) -> torch.Tensor:
    """The old path: decoder and head called directly, the head over completion positions."""
    from stages.lib.model.logits import token_logprobs
    from stages.rl.algo.packing import layout

    lay = layout(samples, device, 0, packed=False)
    hidden = module.get_decoder()(**lay.inputs()).last_hidden_state
    logits = module.get_output_embeddings()(hidden[lay.rows, lay.cols])
    return token_logprobs(logits, lay.targets(), 1.0)


def main(device: str, old_path: bool) -> dict[str, Any]:
    import deepspeed

    from stages.lib.distributed.ds_config import build_ds_config
    from stages.lib.distributed.trainer import DeepSpeedTrainer
    from stages.rl.algo.logprobs import Sample, completion_logprobs

    deepspeed.init_distributed(dist_backend="nccl" if device != "cpu" else "gloo")
    cfg = Settings(3, False)
    trainer = DeepSpeedTrainer(tiny(), cfg, 10, device, build_ds_config(cfg, 1))
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(ids=tuple(int(x) for x in torch.randint(1, 64, (n,), generator=gen)), prompt_len=p)
        for n, p in ((12, 5), (9, 3), (14, 8))
    ]

    def new() -> torch.Tensor:
        lp, _ = completion_logprobs(trainer.module, samples, device, 1.0, 0, call=trainer)
        return torch.cat(lp)

    with torch.no_grad():
        diff = float((new() - direct(trainer.module, samples, device)).abs().max())
    coordinator = trainer.engine.optimizer.parameter_offload.get_param_coordinator()
    traces = []
    for _ in range(3):
        trainer.begin_micro(True)
        lp = direct(trainer.module, samples, device) if old_path else new()
        trainer.backward(-lp.sum())
        trainer.step()
        traces.append(coordinator.is_complete_trace())
    return {"max_diff": diff, "traces": traces}


if __name__ == "__main__":
    result = main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "direct")
    print("RESULT " + json.dumps(result), flush=True)

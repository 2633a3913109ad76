"""What every rollout engine is asked for: the keywords of one `generate` call, declared once.

Input: a step's sampling settings (the stage's `num_repeats`, `temperature`,
`max_output_tokens` and the step's seed). Output: `Sampling`, the keywords that
`generate(prompts, *, batch_size, **sampling)` takes in every engine: `local.LocalEngine`
(which needs `batch_size`) and `vllm_requests.HTTPRollouts` behind `vllm.VLLMEngine` (whose
servers batch their own requests); `pool.EnginePool` and its remote engines pass them on.
"""

from __future__ import annotations

from typing import TypedDict


class Sampling(TypedDict):
    """How many answers per prompt, sampled how, how long, from which seed."""

    num_samples: int
    temperature: float
    max_new_tokens: int
    seed: int

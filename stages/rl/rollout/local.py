"""The rollout engine in the stage's process: the local generator on its own copy of the
policy, whose weights arrive from the actor after every update.

Input: the model directory (architecture and tokenizer), the actor's compute dtype,
prompts. Output: samples with their token ids and the behaviour policy's per-token
log-probabilities (the shared batched generator, prompt KV cache shared by a group's
samples, rows leaving the batch as they finish), greedy answers for held-out scoring, and
the probe's log-probabilities after a sync. With the actor's LoRA the engine generates with
its own copy of the adapters (unmerged), which each sync refills. `sleep` frees the weights
(the hybrid engine, while the actor trains); `wake_weights` allocates them again, to be filled
by the next sync; the KV cache is allocated per generation call, so `wake_cache` has nothing to
reserve here.

One name, two sides of one concept (the `local` engine, generation in the stage's own process:
collect's and evaluate's backend, `stages/lib/backends/local.py`; this file: rl's rollout engine).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from stages.lib.chat.prompt import Prompt
from stages.lib.chat.tokens import eos_ids, pad_id
from stages.lib.model.generate import Generation, generate_with
from stages.rl.algo.logprobs import Sample, completion_logprobs
from stages.rl.sync.transports import SAME_FUNCTION

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from stages.rl.rollout.generate_args import Sampling

log = logging.getLogger("pipe.rl")


class LocalEngine:
    """One in-process engine (`local-0`)."""

    name = "local-0"

    probe_rule = SAME_FUNCTION  # the actor's own model code, dtype path and adapter math

    def __init__(
        self,
        model_dir: str,
        device: str = "cpu",
        bf16: bool = False,
        lora: Any = None,
        autocast: bool = False,
    ) -> None:
        """The policy of `model_dir` on `device` computing the actor's function: in bfloat16
        when the actor's module is bf16 (DeepSpeed in bf16), in bf16 autocast over float32
        weights when the actor's is (`autocast`: the torch trainer in bf16), in float32
        otherwise, whatever dtype the checkpoint was saved in; with the actor's `lora` adapters
        on it (`stages.lib.model.lora`: a sync fills them, the base stays as loaded). The
        probe compares the two sides token for token (`stages.rl.sync.transports.verify`)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = torch.bfloat16 if bf16 and not autocast else torch.float32
        self.autocast = autocast
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        if lora is not None:
            from stages.lib.model.lora.wrap import with_lora

            model = with_lora(model, lora, inference=True)
        model.eval()
        if device != "cpu":
            model.to(device)
        self.model = model
        self.device = device
        self.asleep = False
        self.shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}

    @property
    def pad_id(self) -> int:
        return pad_id(self.tokenizer, self.model.config)

    @property
    def stop_ids(self) -> list[int]:
        """The ids that end an answer here (`stages.lib.model.generate` stops at each)."""
        model = self.model
        return eos_ids(self.tokenizer, model.config, getattr(model, "generation_config", None))

    def generate(
        self, prompts: Sequence[Prompt], *, batch_size: int, **sampling: Unpack[Sampling]
    ) -> list[list[Generation]]:
        """`num_samples` answers per prompt with token ids and behaviour log-probabilities."""
        with self.computing():
            return generate_with(
                self.model,
                self.tokenizer,
                prompts,
                num_samples=sampling["num_samples"],
                temperature=sampling["temperature"],
                top_p=1.0,
                max_new_tokens=sampling["max_new_tokens"],
                seed=sampling["seed"],
                batch_size=batch_size,
                logprobs=sampling["temperature"] > 0,
            )

    def score(self, sample: Sample, temperature: float) -> list[float]:
        """Log-probabilities of the sample's completion tokens under the engine's weights."""
        with torch.no_grad(), self.computing():
            lp, _ = completion_logprobs(self.model, [sample], self.device, temperature, self.pad_id)
        return [float(x) for x in lp[0]]

    def scores(self, sample: Sample) -> dict[str, list[float]]:
        """The probe's log-probabilities per engine (one here), at temperature 1."""
        return {self.name: self.score(sample, 1.0)}

    def computing(self) -> contextlib.AbstractContextManager[Any]:
        """The actor's compute: bf16 autocast over fp32 weights (the torch trainer), else as
        the weights are."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.split(":")[0], dtype=torch.bfloat16)

    def sleep(self) -> int:
        """Free the weights; returns the bytes freed."""
        freed = 0
        for name, p in self.model.named_parameters():
            self.shapes[name] = (p.shape, p.dtype)
            freed += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.asleep = True
        return freed

    def wake_weights(self) -> int:
        """Allocate the weights again (their values come with the next sync)."""
        allocated = 0
        for name, p in self.model.named_parameters():
            shape, dtype = self.shapes[name]
            p.data = torch.empty(shape, dtype=dtype, device=self.device)
            allocated += p.numel() * p.element_size()
        self.asleep = False
        return allocated

    def wake_cache(self) -> int:
        """Nothing to reserve: the local generator allocates its KV cache per call."""
        return 0

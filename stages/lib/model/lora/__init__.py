"""LoRA adapters (peft) on a trained model: the `lora:` block of train and of the rl actor.

Input: the stage's `lora:` values. Output: `LoraBlock`, the block's settings (light: the
kinds' configs import it). The rest of the package, by concern:

- `refusals`: plan time: what cannot act, located (`check_lora`);
- `targets`: `target_modules` matched as peft matches them, and a checkpoint's modules read
  from its `.safetensors` headers (a name no module has is refused, at plan or at load);
- `wrap`: the model with adapters on its target modules, only they trainable (frozen base
  weights get no gradient and no optimizer state, a frozen embedding no dense gradient),
  and the model a rank trains (`load_trained`); the adapters' own parameters;
- `four_bit`: a base loaded in 4 bits for adapters (QLoRA);
- `files`: peft's adapter files (`adapter_config.json`, `adapter_model.safetensors`);
- `output`: the stage's output, merged into an ordinary checkpoint (default) or the adapter
  alone (`save: adapter`);
- `sync_writer`: the adapters as files a vLLM server loads after each weight sync.

The settings follow peft's `LoraConfig` and OpenRLHF's flags (`--lora_rank`, `--lora_alpha`,
`--lora_dropout`, `--target_modules`, `--load_in_4bit`): `alpha` defaults to twice the rank
(TRL's habit, r 16 / alpha 32), so the scale alpha / rank stays 2 when the rank changes;
`target_modules: all-linear` is peft's every linear layer but the output head.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from stages.lib.block import Block

ALL_LINEAR: Literal["all-linear"] = "all-linear"
# the linear projections of the decoder families pipe builds and reads (Llama, Qwen2,
# Mistral, Gemma): what `all-linear` adapts, and the names a memory estimate can size
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_HELP = (
    "Train low-rank adapters (peft) instead of every weight: {rank, alpha, dropout, "
    "target_modules, save, load_in_4bit}; empty: full fine-tuning."
)


class LoraBlock(Block):
    """Low-rank adapters on the target modules; the base weights stay frozen."""

    rank: int = Field(16, gt=0, description="The adapters' rank r (OpenRLHF's --lora_rank).")
    alpha: float | None = Field(
        None,
        gt=0,
        description="Scale numerator: the update is (alpha / rank) B A; empty: 2 x rank.",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        ALL_LINEAR,
        description="'all-linear' (every linear layer but the output head), or module names "
        "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).",
    )
    save: Literal["merged", "adapter"] = Field(
        "merged",
        description="merged: the output is an ordinary checkpoint with the adapters folded in; "
        "adapter: peft's adapter files only (no later stage can read it as a model).",
    )
    load_in_4bit: bool = Field(
        False,
        description="Load the frozen base in 4 bits (QLoRA, bitsandbytes; GPU only).",
    )

    @field_validator("target_modules")
    @classmethod
    def _some(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("expected 'all-linear' or at least one module name, found []")
        return value

    @property
    def scale_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    def targets(self) -> tuple[str, ...]:
        """The target modules' own names, `all-linear` as the decoder's projections (a dotted
        name, `mlp.down_proj`, as its last part: peft matches the end of a module's name)."""
        if self.target_modules == ALL_LINEAR:
            return PROJECTIONS
        return tuple(dict.fromkeys(t.rsplit(".", 1)[-1] for t in self.target_modules))

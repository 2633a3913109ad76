"""Which train settings act under which algorithm: the plan-time refusals of the rest.

Input: a resolved `TrainConfig` (as `Objective`) and its `ResolveContext` (what the user or
a preset set: `ctx.explicit`). Output: located diagnostics for settings set where they act
on nothing, and for a reward model's data files that exist now and hold rows it cannot read.

- `algorithm: rm` trains a scalar head on whole responses: `target` (what an SFT row
  trains on) and `beta` (DPO's) act on nothing; its held-out figure is pairwise accuracy on
  `eval_input`'s pairs, so nothing is generated or verified (`verifier`,
  `eval_max_tokens`). Its `input` and `eval_input`, when they are files that exist at plan
  time, must hold preference pairs or scored rollouts (`stages.lib.io.preference`).
- `margin` acts in the reward model's loss only.
- `lora` with `algorithm: rm` is refused: the new scalar head must train whole, and the
  adapters' merge and sync paths know causal-LM checkpoints only.
"""

from __future__ import annotations

from typing import Protocol

from engine.errors import Diagnostic
from engine.stage import ResolveContext
from stages.lib.io.preference import check_pairs_file


class Objective(Protocol):
    """The fields of `stages.train.TrainConfig` these checks read (the config imports this
    module, so it is not imported back)."""

    @property
    def algorithm(self) -> str: ...
    @property
    def input(self) -> str | None: ...
    @property
    def eval_input(self) -> str | None: ...


RM_IDLE = {
    "target": "a reward model scores whole responses (chosen and rejected), so there is no "
    "target to pick",
    "beta": "beta is dpo's KL strength",
    "eval_max_tokens": "rm's held-out figure is pairwise accuracy on eval_input's pairs: "
    "nothing is generated",
    "verifier": "rm's held-out figure is pairwise accuracy on eval_input's pairs: nothing is "
    "verified",
}


def check_objective(cfg: Objective, ctx: ResolveContext) -> list[Diagnostic]:
    """See the module docstring."""
    out: list[Diagnostic] = []
    set_here = sorted(ctx.explicit)
    if cfg.algorithm == "rm":
        for name, why in RM_IDLE.items():
            path = next((p for p in set_here if p == name or p.startswith(name + ".")), None)
            if path is not None:
                out.append(
                    ctx.error(path, f"acts on nothing with algorithm rm ({why}): leave it out")
                )
        lora = next((p for p in set_here if p == "lora" or p.startswith("lora.")), None)
        if lora is not None:
            out.append(
                ctx.error(
                    lora,
                    "a reward model trains its new scalar head whole, and LoRA here adapts "
                    "causal-LM checkpoints only: leave lora out with algorithm rm",
                )
            )
        out += check_pairs_file(ctx, "input", cfg.input, rollouts_too=True)
        out += check_pairs_file(ctx, "eval_input", cfg.eval_input, rollouts_too=True)
    elif "margin" in ctx.explicit:
        out.append(
            ctx.error(
                "margin",
                f"acts in the reward model's loss only (algorithm rm); algorithm is "
                f"{cfg.algorithm}: leave it out",
            )
        )
    return out

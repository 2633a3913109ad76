"""Plan time: the `lora:` settings that could not act, refused where they are written.

Input: the resolved `LoraBlock`, the stage's resolve context, its config (ZeRO stage,
trainer) and the trained role's GPUs. Output: located diagnostics (`check_lora`), and where a
refusal of the whole block points (`lora_path`). Light: no torch, no peft.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from engine.errors import Diagnostic
from engine.stage import ResolveContext
from stages.lib.model.lora import PROJECTIONS, LoraBlock

BNB_NEEDS_GPU = (
    "4-bit loading (QLoRA) is bitsandbytes' CUDA kernels: it has no 4-bit training path on the "
    "CPU here"
)


def check_lora(
    lora: LoraBlock | None, ctx: ResolveContext, cfg: Any, gpus: int, role: str = ""
) -> list[Diagnostic]:
    """Refusals of `lora` settings that could not act, located: under ZeRO-3, with 4-bit
    loading where bitsandbytes cannot run (`gpus`: the trained role's GPUs) or with a
    DeepSpeed trainer; module names the memory model cannot size are a warning."""
    if lora is None:
        return []
    out: list[Diagnostic] = []
    who = f"the {role}'s " if role else ""
    if cfg.zero_stage == 3:
        out.append(
            ctx.error(
                lora_path(lora),
                f"LoRA under ZeRO-3 ({ctx.source('zero_stage')}) is not supported: {who}adapters "
                "are made after the partitioned model and would train unpartitioned, and the "
                "frozen base needs no optimizer states to shard; use zero_stage 0, 1 or 2",
            )
        )
    if lora.load_in_4bit:
        if gpus == 0:
            out.append(ctx.error("lora.load_in_4bit", f"{BNB_NEEDS_GPU}; this stage has no GPU"))
        elif importlib.util.find_spec("bitsandbytes") is None:
            out.append(
                ctx.error(
                    "lora.load_in_4bit",
                    "4-bit loading needs bitsandbytes, which is not installed: "
                    "pip install bitsandbytes",
                )
            )
        if cfg.trainer == "deepspeed":
            out.append(
                ctx.error(
                    "lora.load_in_4bit",
                    "a 4-bit base trains with plain torch: DeepSpeed casts and moves the whole "
                    "module, which bitsandbytes' packed weights do not survive; set trainer "
                    "auto or torch",
                )
            )
    unknown = [m for m in lora.targets() if m not in PROJECTIONS]
    if unknown:
        out.append(
            ctx.warning(
                "lora.target_modules",
                f"{', '.join(repr(m) for m in unknown)}: not a decoder projection the memory "
                f"estimate knows ({', '.join(PROJECTIONS)}); counted as none, and the run fails "
                "if the model has no module of that name",
            )
        )
    return out


def lora_path(lora: LoraBlock) -> str:
    """Where a refusal of the whole block points: the first key the user wrote in it (a
    block's own line has no recorded place; its keys do)."""
    return next((f"lora.{k}" for k in LoraBlock.model_fields if k in lora.model_fields_set), "lora")

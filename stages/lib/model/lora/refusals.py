"""Plan time: the `lora:` settings that could not act, refused where they are written.

Input: the resolved `LoraBlock`, the stage's resolve context, its config (ZeRO stage,
trainer, the trained model) and the trained role's GPUs. Output: located diagnostics
(`check_lora`; a target module that matches none of a checkpoint's, `check_targets`), and
where a refusal of the whole block points (`lora_path`). Light: no torch, no peft.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from engine.errors import Diagnostic
from engine.stage import ResolveContext
from stages.lib.model.lora import PROJECTIONS, LoraBlock
from stages.lib.model.lora.targets import Modules, checkpoint_modules, refusal, unmatched
from stages.lib.model.path import local_folder

BNB_NEEDS_GPU = (
    "4-bit loading (QLoRA) is bitsandbytes' CUDA kernels: it has no 4-bit training path on the "
    "CPU here"
)


def check_lora(
    lora: LoraBlock | None, ctx: ResolveContext, cfg: Any, gpus: int, role: str = ""
) -> list[Diagnostic]:
    """Refusals of `lora` settings that could not act, located: under ZeRO-3, with 4-bit
    loading where bitsandbytes cannot run (`gpus`: the trained role's GPUs) or with a
    DeepSpeed trainer, and a target that matches no module of `cfg.model` where its modules
    are known now (`check_targets`); module names the memory model cannot size are a
    warning."""
    if lora is None:
        return []
    out, refused = check_targets(lora, ctx, cfg.model)
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
    unknown = [m for m in lora.targets() if m not in PROJECTIONS and m not in refused]
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


def check_targets(
    lora: LoraBlock, ctx: ResolveContext, model: Any
) -> tuple[list[Diagnostic], set[str]]:
    """Each target that matches no module of `model`, refused where it is written (the list's
    entry), with the closest real name; and those names. Known now for a checkpoint folder or
    a hub model the cache holds, from its `.safetensors` headers; else the run refuses, before
    the first step (`stages.lib.model.lora.wrap.with_lora`)."""
    modules = plan_modules(model, ctx)
    if modules is None:
        return [], set()
    targets = lora.target_modules
    bad = unmatched(targets, modules.names)
    if isinstance(targets, str):
        where = [("lora.target_modules", t) for t in bad]
    else:
        where = [(f"lora.target_modules.{i}", t) for i, t in enumerate(targets) if t in bad]
    return [ctx.error(path, refusal(t, modules)) for path, t in where], set(bad)


def plan_modules(model: Any, ctx: ResolveContext) -> Modules | None:
    """The modules of the checkpoint `model` names, read without torch: a folder (not an
    earlier stage's output, whose folder a previous run may have left) or a hub id's snapshot
    in the local cache; None for what is known only once it loads."""
    if not isinstance(model, str) or ctx.is_produced(model) or "://" in model:
        return None
    folder = local_folder(model)
    return checkpoint_modules(folder) if folder else None


def lora_path(lora: LoraBlock) -> str:
    """Where a refusal of the whole block points: the first key the user wrote in it (a
    block's own line has no recorded place; its keys do)."""
    return next((f"lora.{k}" for k in LoraBlock.model_fields if k in lora.model_fields_set), "lora")

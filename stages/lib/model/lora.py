"""LoRA adapters (peft) on a trained model: the `lora:` block of train and of the rl actor.

Input: the resolved `LoraBlock`, the stage's resolve context (its checks) or the loaded
model (its ranks and engines). Output: located refusals of what cannot act; the model with
adapters on its target modules, only they trainable (frozen base weights get no gradient and
no optimizer state, a frozen embedding no dense gradient); the adapter's own parameters (what
a weight sync sends); and the stage's output, merged into an ordinary checkpoint (default)
or the adapter alone (`save: adapter`, peft's `adapter_config.json` and
`adapter_model.safetensors`).

The settings follow peft's `LoraConfig` and OpenRLHF's flags (`--lora_rank`, `--lora_alpha`,
`--lora_dropout`, `--target_modules`, `--load_in_4bit`): `alpha` defaults to twice the rank
(TRL's habit, r 16 / alpha 32), so the scale alpha / rank stays 2 when the rank changes;
`target_modules: all-linear` is peft's every linear layer but the output head.

Merging reloads the base from the input checkpoint in the save dtype on the host, loads the
trained adapter into it and merges there: one rounding into the save dtype, and the same
path whatever the training precision (a 4-bit base merges into its full-precision weights,
as QLoRA exports do). Imports nothing heavy at module level: the kinds' configs import it.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
from typing import Any, Literal

from pydantic import Field, field_validator

from engine.errors import Diagnostic
from engine.stage import ResolveContext
from stages.lib.block import Block

ALL_LINEAR: Literal["all-linear"] = "all-linear"
# the linear projections of the decoder families pipe builds and reads (Llama, Qwen2,
# Mistral, Gemma): what `all-linear` adapts, and the names a memory estimate can size
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
BNB_NEEDS_GPU = (
    "4-bit loading (QLoRA) is bitsandbytes' CUDA kernels: it has no 4-bit training path on the "
    "CPU here"
)


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
        """The target module names, `all-linear` as the decoder's projections."""
        return PROJECTIONS if self.target_modules == ALL_LINEAR else tuple(self.target_modules)


# -- plan time -------------------------------------------------------------------------------


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


# -- run time ---------------------------------------------------------------------------------


def peft_config(lora: LoraBlock, inference: bool = False) -> Any:
    from peft import LoraConfig, TaskType

    targets = lora.target_modules
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=lora.rank,
        lora_alpha=lora.scale_alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
        bias="none",
        inference_mode=inference,
    )


def with_lora(model: Any, lora: LoraBlock, inference: bool = False) -> Any:
    """`model` with adapters on its target modules: only they require gradients (the frozen
    base, embeddings included, gets none), in the base's dtype (peft would keep them in fp32
    beside a bf16 base, and the trainer's forward and the engines' then disagree on dtypes)."""
    import warnings

    from peft import get_peft_model

    dtype = next(model.parameters()).dtype
    with warnings.catch_warnings():  # peft 0.21 reads a property transformers 5.24 deprecates
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        wrapped = get_peft_model(model, peft_config(lora, inference), autocast_adapter_dtype=False)
    for name, p in wrapped.named_parameters():
        if "lora_" in name and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return wrapped


def quantized_base(model_dir: str, bf16: bool) -> Any:
    """The causal LM of `model_dir` in 4 bits (bitsandbytes nf4, double quantization, computing
    in the training dtype) on this rank's GPU, ready for adapters (QLoRA). Requirement found in
    peft's `prepare_model_for_kbit_training`: it freezes the base and casts norms to fp32."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    compute = torch.bfloat16 if bf16 else torch.float32
    quant = BitsAndBytesConfig(  # type: ignore[no-untyped-call]
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=quant, device_map={"": local}, dtype=compute
    )
    model = prepare_model_for_kbit_training(  # type: ignore[no-untyped-call]
        model, use_gradient_checkpointing=False
    )
    model.config.use_cache = False
    return model


def load_trained(
    model_dir: str, ds_config: dict[str, Any] | None, lora: LoraBlock | None, bf16: bool
) -> Any:
    """The model a rank trains: the checkpoint as `stages.lib.distributed.rank.load_model`
    loads it, or its 4-bit base, with adapters when `lora` is set."""
    from stages.lib.distributed.rank import load_model

    if lora is None:
        return load_model(model_dir, ds_config)
    if lora.load_in_4bit:
        return with_lora(quantized_base(model_dir, bf16), lora)
    base = load_model(model_dir, ds_config)
    return with_lora(base, lora)


def write_output(
    module: Any,
    state: dict[str, Any] | None,
    lora: LoraBlock | None,
    model_dir: str,
    output: str,
    dtype: str,
) -> None:
    """The stage's final output at `output` in `dtype`: the trained model as a checkpoint
    (`state`: ZeRO-3's gathered weights), or with LoRA merged or the adapter alone."""
    from stages.lib.model.save import write_checkpoint

    if lora is None:
        write_checkpoint(module, state, model_dir, output, dtype)
    elif lora.save == "adapter":
        write_adapter(module, model_dir, output, dtype)
    else:
        write_merged(module, lora, model_dir, output, dtype)


def adapter_params(module: Any) -> list[tuple[str, Any]]:
    """The adapters' parameters by name (what a weight sync sends): the trainable ones."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def adapter_state(module: Any) -> dict[str, Any]:
    """The adapters' weights on the host under peft's saved names (no adapter name)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(module)
    return {k: v.detach().cpu() for k, v in state.items()}


def write_adapter(module: Any, model_dir: str, output: str, dtype: str) -> None:
    """peft's adapter files at `output` (weights in `dtype`), with the input's tokenizer and
    template files beside them; written to a temporary sibling, then renamed into place."""
    import torch
    from safetensors.torch import save_file

    tmp = f"{output.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    cast = getattr(torch, dtype)
    state = {k: v.to(cast).contiguous() for k, v in adapter_state(module).items()}
    save_file(state, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.copy(module.peft_config["default"])  # the live one stays as it trains
    config.base_model_name_or_path = os.path.abspath(model_dir)
    config.inference_mode = True
    config.save_pretrained(tmp)
    _copy_side_files(model_dir, tmp)
    shutil.rmtree(output, ignore_errors=True)
    os.replace(tmp, output)


def write_sync_adapter(module: Any, folder: str) -> dict[str, float]:
    """The adapters as peft files in `folder` (in their training dtype; atomically: written
    beside it, then renamed), for a vLLM server to load; `gather_s`, `send_s` (the write) and
    `bytes` as a weight sync reports them."""
    import time

    from safetensors.torch import save_file

    start = time.perf_counter()
    state = {k: v.contiguous() for k, v in adapter_state(module).items()}
    gathered = time.perf_counter()
    tmp = f"{folder.rstrip('/')}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(state, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.copy(module.peft_config["default"])
    config.inference_mode = True
    config.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    size = os.path.getsize(os.path.join(folder, "adapter_model.safetensors"))
    return {"gather_s": gathered - start, "send_s": time.perf_counter() - gathered, "bytes": size}


def write_merged(module: Any, lora: LoraBlock, model_dir: str, output: str, dtype: str) -> None:
    """An ordinary checkpoint at `output`: the base reloaded from `model_dir` in `dtype` on the
    host, the trained adapters loaded into it and merged (module docstring), saved as
    `stages.lib.model.save.write_checkpoint` saves a fully trained model."""
    import torch
    from peft import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from stages.lib.model.save import write_checkpoint

    state = adapter_state(module)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    fresh = with_lora(base, lora, inference=True)
    result = set_peft_model_state_dict(fresh, state)
    missing = [k for k in getattr(result, "unexpected_keys", ()) if "lora_" in k]
    if missing:
        raise RuntimeError(f"adapter weights that fit no module of the base: {missing[:3]}")
    merged = fresh.merge_and_unload()
    write_checkpoint(merged, None, model_dir, output, dtype)


def _copy_side_files(model_dir: str, out: str) -> None:
    """The input's files that are not weights or model config (tokenizer, chat template)."""
    from stages.lib.model.save import WEIGHT_INDEXES, WEIGHTS

    for name in os.listdir(model_dir):
        src = os.path.join(model_dir, name)
        skip = name in ("config.json", "generation_config.json", *WEIGHT_INDEXES)
        if os.path.isfile(src) and not skip and not name.endswith(WEIGHTS):
            shutil.copy(src, os.path.join(out, name))

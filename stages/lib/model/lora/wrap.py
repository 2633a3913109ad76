"""Adapters on a model: peft's wrapping, and the model a rank trains.

Input: a loaded causal LM (or a checkpoint folder and its ds_config) and the `LoraBlock`.
Output: the model with adapters on its target modules, only they trainable, in the base's
dtype (`with_lora`; a target that matches no module refused first: `check_targets`); the
model a rank trains, with adapters when `lora` is set
(`load_trained`); the adapters' parameters, what a weight sync sends (`adapter_params`).
"""

from __future__ import annotations

from typing import Any

from stages.lib.model.lora import LoraBlock
from stages.lib.model.lora.targets import Modules, refusal, unmatched


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

    check_targets(model, lora)
    dtype = next(model.parameters()).dtype
    with warnings.catch_warnings():  # peft 0.21 reads a property transformers 5.24 deprecates
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        wrapped = get_peft_model(model, peft_config(lora, inference), autocast_adapter_dtype=False)
    for name, p in wrapped.named_parameters():
        if "lora_" in name and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return wrapped


def check_targets(model: Any, lora: LoraBlock) -> None:
    """Refuse, before any step, a target that matches no module of `model`: peft adapts the
    ones that match and says nothing of the others. `pipe plan` refuses it already where it
    can read a checkpoint's modules (`stages.lib.model.lora.refusals.check_targets`); an
    earlier stage's output, a GGUF file or a model built from config is known only here."""
    names = [n for n, _ in model.named_modules()]
    bad = unmatched(lora.target_modules, names)
    if not bad:
        return
    import torch

    layers = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if isinstance(w := getattr(m, "weight", None), torch.Tensor) and w.dim() == 2
    }
    modules = Modules(frozenset(names), tuple(sorted(layers)))
    raise ValueError(f"lora.target_modules: {'; '.join(refusal(t, modules) for t in bad)}")


def load_trained(
    model_dir: str, ds_config: dict[str, Any] | None, lora: LoraBlock | None, bf16: bool
) -> Any:
    """The model a rank trains: the checkpoint as `stages.lib.distributed.rank.load_model`
    loads it, or its 4-bit base, with adapters when `lora` is set."""
    from stages.lib.distributed.rank import load_model
    from stages.lib.model.lora.four_bit import quantized_base

    if lora is None:
        return load_model(model_dir, ds_config)
    if lora.load_in_4bit:
        return with_lora(quantized_base(model_dir, bf16), lora)
    base = load_model(model_dir, ds_config)
    return with_lora(base, lora)


def adapter_params(module: Any) -> list[tuple[str, Any]]:
    """The adapters' parameters by name (what a weight sync sends): the trainable ones."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

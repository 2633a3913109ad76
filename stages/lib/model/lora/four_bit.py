"""A base model loaded in 4 bits for adapters (QLoRA).

Input: a checkpoint folder and the training dtype. Output: the causal LM in 4 bits
(bitsandbytes nf4) on this rank's GPU, frozen, ready for adapters (`quantized_base`). A
4-bit base trains with plain torch (`stages.lib.distributed.trainer_choice`) and merges into
its full-precision weights at the end (`stages.lib.model.lora.output`).
"""

from __future__ import annotations

import os
from typing import Any


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

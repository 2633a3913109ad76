"""A small GGUF file written with `gguf`'s own writer, as llama.cpp's converter writes one.

`write_tiny_gguf(path)` saves a random tiny Llama (hidden 32, 2 layers) beside a byte-level
BPE vocabulary (the 256 byte symbols, a few merges, `<s>` and `</s>`) as
`<path>` and returns the Hugging Face model it was written from, so a test can compare the
converted checkpoint's logits with the original's. The q and k projections are permuted as
llama.cpp's `convert_hf_to_gguf.py` permutes them (`LlamaModel.permute`); transformers undoes
it on load. `chat_template` goes into `tokenizer.chat_template` when given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SIZES = {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 64}
MERGES = ("Ġ t", "h e", "Ġt he")
SPECIALS = ("<s>", "</s>")


def _vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(set(bytes_to_unicode().values()))
    return [*SPECIALS, *symbols, *(m.replace(" ", "") for m in MERGES)]


def _permute(w: Any, heads: int) -> Any:
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_gguf(path: Path, chat_template: str | None = None, seed: int = 0) -> Any:
    """Write the GGUF file (module docstring); the Llama model it holds, in float32."""
    import gguf
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = _vocab()
    s = SIZES
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    types = [gguf.TokenType.CONTROL] * len(SPECIALS)
    w.add_token_types(types + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        q = _permute(state[p + "self_attn.q_proj.weight"], s["heads"])
        k = _permute(state[p + "self_attn.k_proj.weight"], s["kv_heads"])
        for name, value in (
            ("attn_norm", state[p + "input_layernorm.weight"]),
            ("attn_q", q),
            ("attn_k", k),
            ("attn_v", state[p + "self_attn.v_proj.weight"]),
            ("attn_output", state[p + "self_attn.o_proj.weight"]),
            ("ffn_norm", state[p + "post_attention_layernorm.weight"]),
            ("ffn_gate", state[p + "mlp.gate_proj.weight"]),
            ("ffn_up", state[p + "mlp.up_proj.weight"]),
            ("ffn_down", state[p + "mlp.down_proj.weight"]),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(value))
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model

"""The vocabulary projection stays on 2-D inputs, and held-out scoring's memory stays bounded.

At the start of the shipped Gemma 3 pipeline's GRPO stage, the held-out scoring asked torch's
allocator for 67,108,864,000 bytes: transformers projects the prefill's last position through
a 3-D slice of the hidden states, and torch's CPU `linear` on that slice, with the head's
weight frozen, runs a batched matmul over the weight expanded along the batch (262,144 x 640 x
2 bytes x 200 rows), which oneDNN copies on CPUs with bf16 support. `flat_head` gives the head
2-D inputs. The peak is the process's resident high-water mark (`VmHWM`, torch's CPU
allocations included, which tracemalloc does not see), reset through `/proc/self/clear_refs`
once the model is built, so it counts the scoring alone.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stages.lib.builders.tiny import train_tokenizer  # noqa: E402
from stages.lib.model.generate import generate_with  # noqa: E402
from stages.lib.model.logits import flat_head  # noqa: E402
from tests.unit.test_model import TEXTS  # noqa: E402

torch.set_num_threads(1)

VOCAB, HIDDEN = 262_144, 640  # Gemma 3 270m's
ROWS = 16  # scored at once: the old path expanded the head's weight 16 times, 5,120 MiB


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> bool:
    """The peak resident size starts again from the current one (Linux 4.0 on)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def gemma3_head_model(tokenizer: Any) -> Any:
    """Gemma 3 270m's vocabulary and width in one layer, bf16, the head tied to the embeddings
    and frozen (as under LoRA), filled without transformers' slow init: rows of random values
    repeated down each weight (only the shapes matter here)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.initialization import no_init_weights

    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.set_default_dtype(torch.bfloat16)
    try:
        with no_init_weights():
            model = Gemma3ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.tie_weights()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            rows = torch.randn((min(p.shape[0], 4096), *p.shape[1:]), generator=g).mul_(0.05)
            times = -(-p.shape[0] // rows.shape[0])
            p.copy_(rows.to(p.dtype).repeat(times, *[1] * (p.dim() - 1))[: p.shape[0]])
    return model.eval().requires_grad_(False)


def test_heldout_scoring_on_gemma3_shapes_stays_2d_and_within_its_memory_bound():
    from torch.profiler import profile

    tokenizer = train_tokenizer(TEXTS, 300)  # with the chat template
    model = gemma3_head_model(tokenizer)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompts = [f"What is {i} + {2 * i + 1}?" for i in range(ROWS)]
    with profile(record_shapes=True) as prof:  # the profiler's own memory comes before
        built = _status_kib("VmRSS") if _reset_peak() else None
        gens = generate_with(
            model,
            tokenizer,
            prompts,
            num_samples=1,
            temperature=0.0,
            top_p=1.0,
            max_new_tokens=2,
            seed=0,
            batch_size=ROWS,
        )
        added_mib = None if built is None else (_status_kib("VmHWM") - built) / 1024
    assert [len(g) for g in gens] == [1] * ROWS
    wide = [  # a batched matmul over the head's weight expanded along the batch
        e.input_shapes
        for e in prof.events()
        if e.name == "aten::bmm" and any(VOCAB in s for s in e.input_shapes if s)
    ]
    assert wide == []
    if added_mib is not None:  # Linux
        # 16 rows' logits are 8 MiB in bf16, 16 in fp32; the expanded head would be 5,120 MiB
        assert added_mib < 256


@pytest.mark.parametrize("masked", [False, True])
def test_flat_head_gives_the_same_logits_as_the_3d_projection(masked: bool):
    """The same numbers as the head on the 3-D slice (a frozen head, as under LoRA), shaped
    as the model gives them; with a mask, the selected positions as one row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    ids = torch.randint(0, 50, (3, 7))
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[:, 4:] = True
    mask[1, 2] = True
    head = model.get_output_embeddings()
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        seen: list[tuple[str, int]] = []
        spies = [  # registered before ours: the head's caller's view, then the forward's
            head.register_forward_pre_hook(lambda _m, a: seen.append(("called", a[0].dim()))),
            head.register_forward_hook(lambda _m, a, _o: seen.append(("projected", a[0].dim()))),
        ]
        with flat_head(model, mask if masked else None):
            got = model(input_ids=ids, logits_to_keep=0 if masked else 3).logits
        for spy in spies:
            spy.remove()
    want = whole[mask][None] if masked else whole[:, -3:]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    assert seen == [("called", 3), ("projected", 2)]
    assert head._forward_pre_hooks == {} and head._forward_hooks == {}  # ours are gone

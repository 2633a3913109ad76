"""Packing in the rl actor and critic: a packed micro batch gives the padded one's per-token
log-probabilities, values and loss to 1e-5 (fp32), gradients included; rows are filled
first-fit; the dynamic token budget counts packed tokens."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stages.lib.builders.recipe import TinyModel  # noqa: E402
from stages.lib.builders.tiny import build_tiny_model  # noqa: E402
from stages.rl.algo.logprobs import Sample, completion_logprobs, completion_values  # noqa: E402
from stages.rl.algo.loss import masked_policy_terms  # noqa: E402
from stages.rl.algo.micro import cut  # noqa: E402
from stages.rl.algo.packing import layout, pack  # noqa: E402

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "vocab_size": 300}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("m")
    build_tiny_model(TinyModel(**TINY), [f"{a} + {a} = {2 * a}" for a in range(40)], str(folder), 0)
    return folder


def samples(n: int = 12, seed: int = 0) -> list[Sample]:
    """Varied lengths: prompts 3-40 tokens, answers 1-16, one with an observation masked."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, answer = rng.randint(3, 40), rng.randint(1, 16)
        ids = tuple(rng.randint(8, 299) for _ in range(prompt + answer))
        mask = tuple(int(k % 5 != 2) for k in range(answer)) if i == 3 else ()
        out.append(
            Sample(
                ids, prompt, tuple(-rng.random() for _ in range(answer)), rng.gauss(0, 1), mask=mask
            )
        )
    return out


def test_first_fit_places_every_sample_inside_its_row_without_overlap():
    lengths = [7, 3, 5, 2, 7, 1, 4]
    place = pack(lengths, 7)
    spans: dict[int, list[tuple[int, int]]] = {}
    for n, (row, at) in zip(lengths, place, strict=True):
        assert at + n <= 7
        spans.setdefault(row, []).append((at, at + n))
    for row in spans.values():
        row.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(row))
    assert len(spans) == 5  # 29 tokens in rows of 7: first-fit decreasing needs 5


def test_packed_rows_compute_fewer_positions_than_padded():
    batch = samples()
    padded, packed = layout(batch, "cpu", 0, False), layout(batch, "cpu", 0, True)
    assert packed.ids.shape[1] == padded.ids.shape[1]  # as wide as the longest sample
    assert packed.ids.shape[0] < padded.ids.shape[0]
    assert torch.equal(padded.targets(), packed.targets())  # the same tokens, same order


def test_packed_and_padded_give_the_same_logprobs_loss_and_gradients(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    batch = samples()
    results = []
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        new, ent = completion_logprobs(model, batch, "cpu", 0.8, 0, True, packed=packed)
        flat = torch.cat(new)
        old = torch.tensor([x for s in batch for x in s.old_logprobs])
        adv = torch.tensor([s.advantage for s in batch for _ in range(s.completion_len)])
        mask = torch.tensor([m for s in batch for m in s.loss_mask()])
        loss, kl, _ = masked_policy_terms(flat, old, adv, mask, 0.2, flat.detach() - 0.05, 0.1)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((new, float(ent), float(loss), float(kl), grads))
    (new_a, ent_a, loss_a, kl_a, g_a), (new_b, ent_b, loss_b, kl_b, g_b) = results
    for a, b in zip(new_a, new_b, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert ent_a == pytest.approx(ent_b, abs=1e-5)
    assert loss_a == pytest.approx(loss_b, abs=1e-5) and kl_a == pytest.approx(kl_b, abs=1e-5)
    assert torch.allclose(g_a, g_b, atol=1e-5, rtol=1e-4)


def test_packed_logits_need_no_2d_logits_to_keep_which_transformers_5_17_rejects(
    model_dir: Path,
):
    """transformers 5.17 indexes `hidden_states[:, keep, :]`: a 2-D mask raises IndexError.
    The packed pass gives an int and projects only the scored positions' hidden states."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    batch = samples()
    seen: list[Any] = []
    head = model.get_output_embeddings().register_forward_hook(
        lambda _m, args, out: seen.append((tuple(args[0].shape), tuple(out.shape)))
    )

    def call(**kwargs: Any) -> Any:
        seen.append(kwargs["logits_to_keep"])
        return model(**kwargs)

    with torch.no_grad():
        completion_logprobs(model, batch, "cpu", 1.0, 0, call=call, packed=True)
    head.remove()
    scored = sum(s.completion_len for s in batch)
    # the head projects 2-D hidden states (`flat_head`); the logits come out as one row
    assert seen == [0, ((scored, TINY["hidden_size"]), (1, scored, TINY["vocab_size"]))]
    head_module = model.get_output_embeddings()
    assert head_module._forward_pre_hooks == {}  # the selection is gone
    assert head_module._forward_hooks == {}


def test_packed_and_padded_give_the_same_critic_values(model_dir: Path):
    from stages.rl.roles.critic import build_critic

    critic = build_critic(str(model_dir), None)
    torch.nn.init.normal_(critic.value_head.weight)  # a zero head would hide any difference
    batch = samples(seed=1)
    padded = completion_values(critic, batch, "cpu", 0, packed=False)
    packed = completion_values(critic, batch, "cpu", 0, packed=True)
    for a, b in zip(padded, packed, strict=True):
        assert a.shape == (len(a),) and torch.allclose(a, b, atol=1e-5, rtol=0)


def test_the_dynamic_budget_counts_packed_tokens():
    class S:
        def __init__(self, n: int) -> None:
            self.ids = (0,) * n

    share: list[Any] = [S(n) for n in (10, 10, 10, 40)]
    assert [len(m) for m in cut(share, 2, 60, packed=False)] == [3, 1]  # 3 x 10 <= 60 < 2 x 40
    assert [len(m) for m in cut(share, 2, 60, packed=True)] == [3, 1]  # 30 + 40 > 60
    assert [len(m) for m in cut(share, 2, 70, packed=True)] == [4]  # 70 tokens fit
    assert [len(m) for m in cut(share, 2, 70, packed=False)] == [3, 1]  # 2 x 40 > 70

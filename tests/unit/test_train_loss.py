"""Collation, packed attention, the SFT and DPO losses, and one optimizer step in-process."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stages.lib.model.logits import token_logprobs  # noqa: E402
from stages.train import TrainConfig  # noqa: E402
from stages.train.batch_plan import BatchPlan, Micro  # noqa: E402
from stages.train.data import Example, TrainingSet  # noqa: E402
from stages.train.loss import (  # noqa: E402
    collate,
    dpo_terms,
    sequence_logprobs,
    sft_loss_sum,
)

torch.set_num_threads(1)

EXAMPLES = [Example((1, 2, 3), 2), Example((4, 5, 6, 7), 1), Example((8, 9), 1)]


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def test_collate_packed_rows_restart_positions_and_shift_targets():
    batch = collate(Micro((0, 1, 2), ((0, 1), (2,))), EXAMPLES, pad_id=0, packed=True)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7], [8, 9, 0, 0, 0, 0, 0]]
    assert batch.position_ids is not None and batch.attention_mask is None
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4]]
    assert batch.targets.tolist() == [
        [-100, 3, -100, 5, 6, 7, -100],
        [9, -100, -100, -100, -100, -100, -100],
    ]
    assert batch.slots.tolist() == [[0, 0, 0, 1, 1, 1, 1], [2, 2, 0, 0, 0, 0, 0]]
    assert batch.seqs == (0, 1, 2)
    assert batch.tokens == 9


def test_collate_padded_rows_carry_an_attention_mask():
    batch = collate(Micro((0, 1), ((0,), (1,))), EXAMPLES, pad_id=0, packed=False)
    assert batch.input_ids.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert batch.position_ids is None and batch.attention_mask is not None
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch.targets.tolist() == [[-100, 3, -100, -100], [5, 6, 7, -100]]


def test_dummy_micro_batch_has_no_targets():
    batch = collate(Micro((), ((0,),), dummy=True), EXAMPLES, pad_id=0, packed=False)
    assert batch.targets.tolist() == [[-100, -100, -100]]
    assert batch.tokens == 0


def test_packed_sequences_attend_only_within_themselves():
    model = tiny_llama()
    packed = collate(Micro((0, 1, 2), ((1, 0, 2),)), EXAMPLES, pad_id=0, packed=True)
    with torch.no_grad():
        together = model(**packed.model_inputs("cpu")).logits[0]
        at = 0
        for s in (1, 0, 2):
            ids = torch.tensor([EXAMPLES[s].input_ids])
            alone = model(input_ids=ids, use_cache=False).logits[0]
            n = ids.shape[1]
            torch.testing.assert_close(together[at : at + n], alone, rtol=1e-4, atol=1e-5)
            at += n


def test_sft_loss_sums_response_token_nll():
    logits = torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(0))
    batch = collate(Micro((1,), ((1,),)), [EXAMPLES[0], Example((4, 5, 6, 7), 1)], 0, False)
    logp = torch.log_softmax(logits, -1)[0]
    expected = -(logp[0, 5] + logp[1, 6] + logp[2, 7])
    torch.testing.assert_close(sft_loss_sum(logits, batch), expected)
    lp = token_logprobs(logits, batch.targets)
    assert lp[0, 3].item() == 0.0


def test_sequence_logprobs_follow_slots():
    logits = torch.randn(1, 7, 10, generator=torch.Generator().manual_seed(1))
    batch = collate(Micro((0, 1), ((0, 1),)), EXAMPLES, pad_id=0, packed=True)
    logp = torch.log_softmax(logits, -1)[0]
    expected = torch.stack([logp[1, 3], logp[3, 5] + logp[4, 6] + logp[5, 7]])
    torch.testing.assert_close(sequence_logprobs(logits, batch), expected)


def test_dpo_loss_value():
    policy = torch.tensor([-1.0, -2.0, -3.0, -1.0])
    reference = torch.tensor([-1.5, -1.5, -2.0, -2.0])
    losses, margins = dpo_terms(policy, reference, beta=0.1)
    # pair 0: 0.1 x ((-1 + 1.5) - (-2 + 1.5)) = 0.1; pair 1: 0.1 x (-1 - 1) = -0.2
    torch.testing.assert_close(margins, torch.tensor([0.1, -0.2]))
    expected = [math.log1p(math.exp(-0.1)), math.log1p(math.exp(0.2))]
    torch.testing.assert_close(losses, torch.tensor(expected))


def one_step(packing: bool, dynamic: bool, micro: int) -> dict[str, object]:
    """Weights after one AdamW step on the same 6 sequences, batched differently."""
    from stages.lib.distributed.trainer import TorchTrainer
    from stages.train.loop import Loop

    gen = torch.Generator().manual_seed(3)
    examples = []
    for n in (5, 9, 3, 12, 7, 4):
        ids = torch.randint(1, 40, (n,), generator=gen).tolist()
        examples.append(Example(tuple(ids), 2))
    data = TrainingSet(examples, [(i,) for i in range(6)], 0)
    cfg = TrainConfig(
        input="x",
        model="x",
        train_batch_size=6,
        micro_train_batch_size=micro,
        max_length=16,
        packing_samples=packing,
        use_dynamic_batch=dynamic,
        lr_scheduler="constant",
        warmup_ratio=0.0,
    )
    plan = BatchPlan(
        data.units,
        [len(e.input_ids) for e in examples],
        train_batch_size=6,
        micro_batch_size=micro,
        world_size=1,
        max_length=16,
        packing=packing,
        dynamic=dynamic,
        seed=0,
        max_epochs=1,
        max_steps=None,
    )
    trainer = TorchTrainer(tiny_llama(), cfg, plan.total_steps, "cpu")
    loop = Loop(
        cfg=cfg, trainer=trainer, plan=plan, data=data, device="cpu", pad_id=0, stage_dir=""
    )
    record = loop.run_step(plan.step(0))
    return {"loss": record["loss"], "lr": record["lr"], "weights": trainer.module.state_dict()}


def test_every_batching_gives_the_same_step():
    """The loss is the mean over the global batch's response tokens, however it is cut."""
    base = one_step(packing=False, dynamic=False, micro=6)
    for packing, dynamic, micro in ((False, False, 1), (True, False, 4), (True, True, 1)):
        other = one_step(packing, dynamic, micro)
        assert other["loss"] == pytest.approx(base["loss"], rel=1e-5)
        assert other["lr"] == base["lr"] == 1e-3
        for name, w in base["weights"].items():  # type: ignore[union-attr]
            torch.testing.assert_close(other["weights"][name], w, rtol=1e-4, atol=1e-6)  # type: ignore[index]


@pytest.mark.parametrize("packed", [False, True])
def test_logits_only_where_the_loss_reads_give_the_full_vocabularys_loss_and_gradients(packed):
    """At a 150k-token vocabulary the projection at every position was the largest cost of a
    step (3.97 s against 1.36 s for 16 rows): the loss and every gradient are the same when
    only the answer positions are projected (`stages.lib.model.logits.flat_head`)."""
    from stages.lib.model.logits import flat_head

    micro = Micro(rows=((0, 1), (2,)) if packed else ((0,), (1,), (2,)), units=(0, 1, 2))
    batch = collate(micro, EXAMPLES, pad_id=0, packed=packed)
    results = []
    for only_scored in (False, True):
        model = tiny_llama()
        scored = batch.scored("cpu")
        with flat_head(model, scored if only_scored else None):
            logits = model(**batch.model_inputs("cpu")).logits
        assert logits.shape[:2] == ((1, int(scored.sum())) if only_scored else batch.targets.shape)
        loss = sft_loss_sum(logits, batch.at(scored) if only_scored else batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (full, full_grads), (only, only_grads) = results
    torch.testing.assert_close(only, full)
    assert full.item() > 0
    for name, grad in full_grads.items():
        torch.testing.assert_close(only_grads[name], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["chatml", "llama3", "gemma", "mistral"])
def test_each_familys_model_gives_the_same_sft_loss_with_logits_only_at_the_answer(
    family, family_checkpoint
):
    """The selection sits before the family's own head (Gemma 2 soft-caps its logits after
    it): the same loss and gradients on every architecture the test checkpoints cover. In
    float64: the head's weight gradient sums over every position on one side and over the
    answer positions on the other, and in float32 that reordering alone moved a few of its
    16,384 elements by up to 2.4e-6 (relative 7e-5) with 2 threads, while the claim here is
    that the two compute the same thing."""
    from transformers import AutoModelForCausalLM

    from stages.lib.model.logits import flat_head

    micro = Micro(rows=((0, 1), (2,)), units=(0, 1, 2))
    batch = collate(micro, EXAMPLES, pad_id=0, packed=True)
    scored = batch.scored("cpu")
    results = []
    for only_scored in (False, True):
        model = AutoModelForCausalLM.from_pretrained(family_checkpoint(family), dtype=torch.float64)
        with flat_head(model, scored if only_scored else None):
            logits = model(**batch.model_inputs("cpu")).logits
        loss = sft_loss_sum(logits, batch.at(scored) if only_scored else batch)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (full, full_grads), (only, only_grads) = results
    torch.testing.assert_close(only, full)
    for name, grad in full_grads.items():
        torch.testing.assert_close(only_grads[name], grad, rtol=1e-5, atol=1e-6)

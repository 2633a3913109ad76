"""Sequence parallelism (`ring_attn_size`, `stages.lib.distributed.seqpar`) against one rank.

Two gloo ranks, each holding half of every row, give the loss and the gradients one rank gives
on the whole rows, for a tiny Llama built from config and rows longer than a rank's share.

Tolerance: fp32 throughout. The two sides compute the same products per position and per
head; what differs is the order of additions (a shard's GEMMs over fewer rows, each weight's
gradient summed from two ranks' partial backward passes instead of one), which moves a result
by a few units of fp32's 1.2e-7 relative precision per addition chain. rtol 1e-5 and atol
1e-6 allow that, and no more: one position attending to the wrong keys, a wrong rotary
position or a lost gradient term moves the loss and gradients by 1e-2 or more here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

RTOL, ATOL = 1e-5, 1e-6
WIDTHS = (11, 7)  # two rows, the second right-padded; 11 is odd: the width pads to 12


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: two query heads per key/value head
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).float()


def _batch() -> Any:
    from stages.train.batch_plan import Micro
    from stages.train.data import Example
    from stages.train.loss import collate

    g = torch.Generator().manual_seed(1)
    examples = []
    for width in WIDTHS:
        ids = torch.randint(1, 64, (width,), generator=g).tolist()
        examples.append(Example(input_ids=tuple(ids), prompt_len=2))
    micro = Micro(units=(0, 1), rows=((0,), (1,)))
    return collate(micro, examples, pad_id=0, packed=False)


def _loss_and_grads(model: Any, batch: Any, tokens: int) -> tuple[float, dict[str, Any]]:
    from stages.lib.model.logits import flat_head
    from stages.train.loss import sft_loss_sum

    scored = batch.scored("cpu")
    with flat_head(model, scored):
        logits = model(**batch.model_inputs("cpu")).logits
    loss = sft_loss_sum(logits, batch.at(scored)) / tokens
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from stages.lib.distributed import seqpar

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sp = seqpar.split_world(world, rank, world)
    model = _model()
    seqpar.check_heads(model.config, sp.size)
    batch = _batch()
    tokens = int((batch.targets != -100).sum())  # the global count: every shard's denominator
    with seqpar.active(sp):
        loss, grads = _loss_and_grads(model, batch.shard(sp), tokens)
    # the group's gradients summed (the trainers' average over W ranks of loss x W / tokens)
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    dist.all_reduce(flat)
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        torch.save({"loss": float(total), "grads": flat}, out)
    dist.destroy_process_group()


def test_two_gloo_ranks_give_one_ranks_loss_and_gradients(tmp_path: Path) -> None:
    from stages.lib.net import free_port

    batch = _batch()
    assert batch.input_ids.shape[1] == max(WIDTHS) > max(WIDTHS) // 2 + 1  # longer than a share
    tokens = int((batch.targets != -100).sum())
    loss, grads = _loss_and_grads(_model(), batch, tokens)  # one rank, the whole rows
    out = str(tmp_path / "sp.pt")
    # forked: the ranks start with torch and transformers loaded
    torch.multiprocessing.start_processes(
        _rank, args=(2, free_port(), out), nprocs=2, start_method="fork"
    )
    sp = torch.load(out)
    assert sp["loss"] == pytest.approx(loss, rel=RTOL, abs=ATOL)  # measured: 1.2e-7 apart
    one = torch.cat([g.reshape(-1) for g in grads.values()])
    assert one.abs().max() > 1e-3  # gradients that say something
    torch.testing.assert_close(sp["grads"], one, rtol=RTOL, atol=ATOL)  # measured: 3.0e-8


def test_heads_that_do_not_split_are_refused() -> None:
    from stages.lib.distributed import seqpar

    config = _model().config
    with pytest.raises(ValueError) as err:
        seqpar.check_heads(config, 4)  # 4 query heads, 2 key/value heads
    assert str(err.value) == (
        "ring_attn_size 4 must divide the model's attention heads (4) and key/value heads (2): "
        "each rank attends with 1/4 of them"
    )
    config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="it uses 'eager'"):
        seqpar.check_heads(config, 2)


PIPELINE = """\
name: sp
cluster: {scheduler: local, workers: 1, gpus: 0}
stages:
  train:
    kind: train
    config:
      input: data.jsonl
      model: {hidden_size: 32, num_layers: 2, num_heads: 2, vocab_size: 300}
      num_processes: 3
      ring_attn_size: 4
      packing_samples: true
      algorithm: dpo
      train_batch_size: 12
      micro_train_batch_size: 4
"""


def test_plan_refuses_what_sequence_parallelism_does_not_do(tmp_path: Path, pipe_cli: Any):
    (tmp_path / "data.jsonl").write_text("")
    (tmp_path / "p.yaml").write_text(PIPELINE)
    result = pipe_cli("plan", str(tmp_path / "p.yaml"))
    assert result.exit_code == 2
    at = f"{tmp_path / 'p.yaml'}:"
    assert result.stderr.splitlines() == [
        f"{at}10:23: stages.train.config.ring_attn_size: 3 rank(s) do not split into "
        "sequence-parallel groups of 4: use a divisor of 3, or give the stage a multiple of 4 "
        "(num_processes)",
        f"{at}10:23: stages.train.config.ring_attn_size: sequence parallelism trains sft only; "
        f"algorithm is dpo ({at}12:18), whose loss reads whole sequences' log-probabilities: "
        "set ring_attn_size 1",
        f"{at}10:23: stages.train.config.ring_attn_size: 4 does not divide the model's "
        "attention heads (2) and key/value heads (2): each rank attends with 1/4 of them",
        f"{at}11:24: stages.train.config.packing_samples: packed rows cannot be split across "
        f"ranks with ring_attn_size 4 ({at}10:23): attention over the gathered rows is causal "
        "over the whole row (SDPA without the packed rows' block mask); turn packing_samples off",
    ]


def test_the_memory_model_counts_a_ranks_share_of_the_sequence() -> None:
    from stages.train import TrainConfig

    cfg = TrainConfig.model_validate(
        {
            "num_processes": 4,
            "ring_attn_size": 2,
            "max_length": 301,
            "train_batch_size": 16,
            "micro_train_batch_size": 8,
        }
    )
    assert cfg.memory_needs()[0].seq_len == 151  # 301 padded to 302, half on each rank


def test_rl_refuses_a_ring_attn_size_it_does_not_act_on(pipe_cli: Any) -> None:
    from tests.conftest import ROOT

    path = "stages.grpo.config.ring_attn_size"
    result = pipe_cli("plan", str(ROOT / "pipelines/grpo_quickstart.yaml"), "--set", f"{path}=2")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"--set {path}=2: {path}: sequence parallelism is not wired into this stage yet (the "
        "actor's, critic's and reference's passes and the per-sequence log-probabilities, "
        "values and KL of stages/rl/roles read whole rows; train has it): set ring_attn_size 1"
    ]


def test_a_sliding_window_shorter_than_the_rows_is_refused() -> None:
    from stages.lib.distributed import seqpar

    config = _model().config
    config.sliding_window = 8
    seqpar.check_heads(config, 2, max_length=8)  # the window covers every row: no mask needed
    with pytest.raises(ValueError) as err:
        seqpar.check_heads(config, 2, max_length=16)
    assert str(err.value) == (
        "ring_attn_size 2: the model's sliding-window attention (8 tokens) would attend over "
        "whole rows of up to max_length 16; set max_length 8 or less, or ring_attn_size 1"
    )

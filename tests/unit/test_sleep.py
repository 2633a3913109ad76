"""The hybrid engine's trainer sleep: which method each case gets, the host mover on a real
torch optimizer, and the rl loop asking both trained roles at the right moments."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.lib.distributed.offload import HostStates, optimizer_tensors
from stages.lib.distributed.sleep import sleep_method
from stages.rl import RLConfig
from stages.rl.algo.logprobs import Sample
from stages.rl.controller.loop import Batch, run_steps


@pytest.mark.parametrize(
    ("trainer", "zero", "offload", "device", "method"),
    [
        ("deepspeed", 3, False, "cpu", "host"),
        ("torch", 0, False, "cpu", "host"),
        ("torch", 0, False, "cuda", "trainer"),
        ("deepspeed", 0, False, "cuda:1", "trainer"),
        ("deepspeed", 1, False, "cuda", "deepspeed"),
        ("deepspeed", 2, False, "cuda", "deepspeed"),
        ("deepspeed", 3, False, "cuda", "zero3"),
        ("deepspeed", 1, True, "cuda", "offloaded"),
        ("deepspeed", 2, True, "cuda", "offloaded"),
        ("deepspeed", 3, True, "cuda", "offloaded"),
    ],
)
def test_each_trainer_zero_stage_offload_and_device_gets_its_method(
    trainer: str, zero: int, offload: bool, device: str, method: str
):
    way = sleep_method(trainer, zero, offload, device)
    assert way.method == method
    assert way.moves == (method not in ("host", "offloaded"))


def adamw_after_a_step(master: bool) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """A model and its AdamW after one step; with `master`, the optimizer steps fp32 copies
    of the weights (as DeepSpeed's bf16 wrapper does) instead of the weights themselves."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    params = [p.detach().clone().requires_grad_() for p in model.parameters()] if master else None
    opt = torch.optim.AdamW(params or model.parameters(), lr=0.1)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


@pytest.mark.parametrize("master", [False, True], ids=["weights", "fp32-copies"])
def test_the_mover_parks_an_optimizers_tensors_and_brings_them_back_unchanged(master: bool):
    model, opt = adamw_after_a_step(master)
    _, twin = adamw_after_a_step(master)
    tensors = optimizer_tensors(opt, model)
    assert len(tensors) == (2 if master else 0) + 2 * 3  # copies; exp_avg, exp_avg_sq, step
    values = [t.clone() for t in tensors]
    host = HostStates(pin=False)
    moved = host.offload(tensors)
    assert moved == sum(t.numel() * t.element_size() for t in tensors)
    parked = [t.data_ptr() for t in tensors]
    assert parked == [host.buffers[id(t)].data_ptr() for t in tensors]  # storage swapped
    assert host.reload() == moved
    assert all(t.data_ptr() != p for t, p in zip(tensors, parked, strict=True))
    assert all(torch.equal(t, v) for t, v in zip(tensors, values, strict=True))
    assert set(opt.state[opt.param_groups[0]["params"][0]]) == {"step", "exp_avg", "exp_avg_sq"}
    for o in (opt, twin):  # the next step is the one it would have been
        for p in o.param_groups[0]["params"]:
            p.grad = torch.full_like(p, 0.5)
        o.step()
    for a, b in zip(opt.param_groups[0]["params"], twin.param_groups[0]["params"], strict=True):
        assert torch.equal(a, b)


class Channel:
    """One role's end of the stage's channel, recording what it is asked."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name, self.log = name, log

    def send(self, kind: str, payload: Any = None) -> None:
        self.log.append((self.name, kind))

    def receive(self, kind: str, timeout_s: float = 0, alive: Any = None) -> dict[str, Any]:
        return {}


class Stage:
    """What run_steps drives (the `Controller` protocol), with a recording channel per role."""

    def __init__(self, tmp: Path, sleeps: bool) -> None:
        self.cfg = RLConfig(max_steps=3, eval_every=100, save_steps=100, log_samples_every=0)
        self.ctx: Any = type("Ctx", (), {"log": logging.getLogger("test")})()
        self.dir, self.total, self.version, self.sleeps = str(tmp), 3, 0, sleeps
        self.log: list[tuple[str, str]] = []
        self.channel: Any = Channel("actor", self.log)
        self.critic: Any = Channel("critic", self.log)

    def generate(self, step: int) -> Batch:
        self.log.append(("engine", "generate"))
        sample = Sample(ids=(1, 2, 3), prompt_len=2, old_logprobs=(-1.0,))
        return Batch(step, [0], [sample], [[1.0]], 1, 0.1, self.version, 1)

    def sync(self, version: int) -> dict[str, Any]:
        self.log.append(("engine", "wake and sync"))
        self.version = version
        return {"sync_s": 0.0, "probe_diff": 0.0, "probe_logprob": None}

    def evaluate(self) -> float | None:
        return None

    def request(self, kind: str, payload: Any = None) -> Any:
        self.channel.send(kind, payload)
        return "ok"

    def actor_alive(self) -> bool:
        return True

    def rest_engine(self) -> None:
        self.log.append(("engine", "sleep"))

    def save(self, step: int) -> None:
        pass


def test_hybrid_order_offload_before_engine_wakes(tmp_path: Path):
    """The memory plan counts the optimizer states off the GPU whenever the engine holds its
    memory: they leave before the engine wakes for the sync (its KV cache with it) and come
    back only after it sleeps. (The KV cache woke before the actor offloaded.)"""
    stage = Stage(tmp_path, sleeps=True)
    run_steps(stage, 0, None)
    offload = [("critic", "offload"), ("actor", "offload")]
    train = [
        ("engine", "sleep"),
        ("critic", "reload"),
        ("actor", "reload"),
        ("actor", "train"),
        ("critic", "train"),
        *offload,
        ("engine", "wake and sync"),
    ]
    generate = [("engine", "generate")]
    assert stage.log == [*offload, *generate, *train, *generate, *train, *generate, *train]
    quiet = Stage(tmp_path, sleeps=False)
    run_steps(quiet, 0, None)
    assert [kind for _, kind in quiet.log if kind in ("offload", "reload")] == []


PLAN = """\
    name: hp
    cluster: {{scheduler: local, workers: 1, gpus: 2, gpus_per_node: 2}}
    resources: {{ratio: {{vllm: 1, actor: 1}}}}
    stages:
      rl:
        kind: rl
        config:
          input: prompts.jsonl
          model: {{hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 300}}
          verifier: {{kind: regex, pattern: "[0-9]"}}
          deepspeed_enable_sleep: true
          zero_stage: {zero}
          adam_offload: {offload}
"""


@pytest.mark.parametrize(
    ("zero", "offload", "says"),
    [
        (0, "false", "deepspeed at ZeRO-0: Adam moments (and bf16's fp32 master weights) moved"),
        (1, "false", "deepspeed at ZeRO-1: fp32 master weights, Adam states and gradient"),
        (2, "false", "deepspeed at ZeRO-2: fp32 master weights, Adam states and gradient"),
        (3, "false", "deepspeed at ZeRO-3: gradient partitions and buckets moved by DeepSpeed"),
        (3, "true", "deepspeed at ZeRO-3 with adam_offload: nothing of the optimizer on the GPU"),
    ],
)
def test_plan_says_what_sleep_moves_never_attribute_error_or_fusedadam_assert(
    tmp_path, zero: int, offload: str, says: str
):
    """DeepSpeed's offload_states exists only on the ZeRO optimizers and asserts FusedAdam at
    ZeRO-3: `pipe plan` says which method each ZeRO stage gets (the CPU round trips of those
    methods on a real DeepSpeed engine: tests/integration/test_rl_sleep.py)."""
    import textwrap

    from tests.conftest import run_cli

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(textwrap.dedent(PLAN.format(zero=zero, offload=offload)))
    result = run_cli("plan", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    assert f"p.yaml:11:31: note: stages.rl.config.deepspeed_enable_sleep: {says}" in (result.stderr)

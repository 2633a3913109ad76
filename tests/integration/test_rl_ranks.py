"""The rl stage's trained ranks for real: ZeRO-3 actor and critic ranks over gloo, driven
through their channel as the stage drives them, on steps whose samples do not divide
evenly over the ranks (before equal micro-batch counts, the rank with one pass more waited
forever in ZeRO-3's gathers). A hang fails the request's time bound, and the ranks are
stopped. The 3-rank ZeRO-3 run's loss and gradient norm equal those of one plain rank
(ZeRO-0): the same per-token losses over the same token count, and every micro batch's
gradient kept (ZeRO-3 used to keep only each rank's last one)."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stages.lib.builders.recipe import TinyModel
from stages.lib.distributed.ds_config import build_ds_config
from stages.lib.distributed.spawn import Ranks, launch
from stages.rl import RLConfig
from stages.rl.roles.brief import ActorBrief
from stages.rl.roles.channel import StageEnd

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BOUND_S = 180  # a train request answered later than this is a hang
VOCAB = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from stages.lib.builders.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("ranks") / "tiny"
    spec = TinyModel(hidden_size=32, num_layers=2, num_heads=2, vocab_size=VOCAB)
    build_tiny_model(
        spec, [f"{a} + {b} = {a + b}" for a in range(20) for b in range(20)], str(out), 0
    )
    return str(out)


def samples(n: int) -> list[dict[str, Any]]:
    """`n` samples of varying length, with what both the actor and the critic train on."""
    rng = random.Random(7)
    out = []
    for i in range(n):
        prompt, answer = rng.randint(3, 8), rng.randint(2, 6)
        out.append(
            {
                "ids": tuple(rng.randrange(3, VOCAB) for _ in range(prompt + answer)),
                "prompt_len": prompt,
                "old_logprobs": tuple(-5.7 for _ in range(answer)),  # ~ log(1/300): ratio ~ 1
                "advantage": 1.0 if i % 2 else -1.0,
                "returns": tuple(rng.uniform(-1, 1) for _ in range(answer)),
                "old_values": tuple(0.0 for _ in range(answer)),
            }
        )
    return out


def run_role(
    tmp: Path, model: str, module: str, world: int, dynamic: bool, n: int = 7, zero: int = 3
) -> dict[str, Any]:
    """Start `world` ranks of `module` (ZeRO `zero`, CPU), train on `n` samples in steps of 4
    (7 on 3 ranks at micro 1: 2/1/1, then 1/1/1 samples), stop them; the train reply."""
    with serving(tmp, model, module, world, dynamic, zero) as request:
        return request("train", {"step": 1, "samples": samples(n)})  # type: ignore[no-any-return]


@contextlib.contextmanager
def serving(
    tmp: Path, model: str, module: str, world: int, dynamic: bool = False, zero: int = 3
) -> Iterator[Callable[[str, Any], Any]]:
    """`world` ranks of `module` answering the requests sent through the yielded function
    (each bounded by BOUND_S); stopped at the end, a hung rank killed."""
    cfg = RLConfig(
        zero_stage=zero,
        micro_train_batch_size=1,
        train_batch_size=4,
        use_dynamic_batch=dynamic,
        learning_rate=0.01,
        eps_clip=0.99,
        algorithm="ppo",
    )
    end = StageEnd()
    brief = ActorBrief(
        config=cfg,
        model_dir=model,
        stage_dir=str(tmp),
        device="cpu",
        trainer="deepspeed",
        ds_config=build_ds_config(cfg, world, model_dir=model),
        threads=1,
        channel=end.address,
        authkey=end.authkey.hex(),
        sync_backend="gloo",
        sync_store="",
        resume_tag=None,
        total_updates=2,
    )
    brief.write(str(tmp / "brief.json"))
    done = threading.Event()
    failures: list[BaseException] = []

    def ranks() -> None:
        try:
            launch(
                module,
                str(tmp / "brief.json"),
                Ranks(world=world),
                "cpu",
                1,
                str(tmp / "ranks.log"),
                logging.getLogger("test"),
                should_stop=lambda: "the test is over" if done.is_set() else None,
            )
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=ranks, daemon=True)
    thread.start()
    try:
        end.accept(thread.is_alive, timeout_s=BOUND_S)
        yield lambda kind, payload: end.request(kind, payload, BOUND_S, thread.is_alive)
        end.request("stop", None, 60, thread.is_alive)
        thread.join(timeout=60)  # the ranks exit after answering `stop`
    finally:
        done.set()  # a hung rank is killed here
        thread.join(timeout=60)
        end.close()
    assert not failures, failures


@pytest.mark.parametrize("dynamic", [False, True], ids=["count", "dynamic"])
def test_zero3_actor_on_three_ranks_finishes_an_uneven_step_with_one_ranks_loss(
    tmp_path: Path, model_dir: str, dynamic: bool
):
    (tmp_path / "one").mkdir()
    (tmp_path / "three").mkdir()
    one = run_role(tmp_path / "one", model_dir, "stages.rl.roles.actor", 1, dynamic, zero=0)
    three = run_role(tmp_path / "three", model_dir, "stages.rl.roles.actor", 3, dynamic)
    assert three["updates"] == one["updates"] == 2
    assert three["tokens"] == one["tokens"]
    for key in ("loss", "entropy", "grad_norm"):
        assert three[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


def test_zero3_critic_on_three_ranks_finishes_an_uneven_step_with_one_ranks_loss(
    tmp_path: Path, model_dir: str
):
    (tmp_path / "one").mkdir()
    (tmp_path / "three").mkdir()
    one = run_role(tmp_path / "one", model_dir, "stages.rl.roles.critic", 1, False, zero=0)
    three = run_role(tmp_path / "three", model_dir, "stages.rl.roles.critic", 3, False)
    assert one["value_loss"] > 0
    assert three["value_loss"] == pytest.approx(one["value_loss"], rel=1e-4)


def test_ranks_idle_past_the_collective_timeout_still_serve(
    tmp_path: Path, model_dir: str, monkeypatch: pytest.MonkeyPatch
):
    """The ranks wait for the next request while the controller generates, evaluates or
    saves, for as long as that takes: not inside a collective (DeepSpeed's 10-minute default
    killed them there). Here a 2 s collective timeout and a 6 s pause between requests."""
    monkeypatch.setenv("PIPE_COLLECTIVE_TIMEOUT_S", "2")
    monkeypatch.setenv("PIPE_REQUEST_POLL_S", "1")  # rank 1's waits time out and go on
    probe = {"ids": (5, 6, 7, 8, 9), "prompt_len": 2}
    with serving(tmp_path, model_dir, "stages.rl.roles.actor", 2, zero=0) as request:
        first = request("probe", probe)
        time.sleep(6)
        assert request("probe", probe) == first
        time.sleep(3)
        reply = request("train", {"step": 1, "samples": samples(4)})
    assert reply["updates"] == 1


def test_an_actor_on_a_llama3_config_with_an_eos_list_and_no_pad_trains(
    tmp_path: Path, family_checkpoint: Callable[..., Path]
):
    """Issue 37: `int()` of Llama 3's `eos_token_id` list killed the actor at start."""
    model = str(family_checkpoint("llama3"))
    reply = run_role(tmp_path, model, "stages.rl.roles.actor", 1, False, zero=0)
    assert reply["updates"] == 2 and reply["tokens"] > 0

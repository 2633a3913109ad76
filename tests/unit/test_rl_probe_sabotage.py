"""The probe after a weight sync catches weights that did not arrive, within one step, in
bf16 and fp32, with full weights and with LoRA (issue 56 point 1).

The actor's side is the model a rank trains (`load_trained`: bf16 as DeepSpeed holds it in
bf16, fp32 otherwise; the torch trainer's bf16 as autocast over fp32 weights), one optimizer
step moves it, and the sync is the real disk transport into the real local engine. A correct
sync scores the probe exactly as the actor does (the same function on the same weights); a
sabotaged one leaves one layer stale, or lands the adapters on only some modules, and
`verify` fails naming the engine."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stages.lib.builders.recipe import TinyModel  # noqa: E402
from stages.lib.builders.tiny import build_tiny_model  # noqa: E402
from stages.lib.model.lora import LoraBlock  # noqa: E402
from stages.rl.algo.logprobs import Sample, completion_logprobs  # noqa: E402
from stages.rl.sync import transports  # noqa: E402

TEXTS = [f"{a} + {b} = {a + b}" for a in range(10) for b in range(10)]
PROBE = Sample(ids=(5, 17, 40, 9, 33, 61, 12, 7, 80, 3), prompt_len=4)
BATCH = [Sample(ids=(3, 9, 27, 81, 14, 42, 6, 18, 54, 11), prompt_len=3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("m")
    spec = TinyModel(hidden_size=32, num_layers=2, num_heads=2, vocab_size=300)
    build_tiny_model(spec, TEXTS, str(folder), seed=0)
    return str(folder)


class Side:
    """The actor's model and how it runs its forward, as `stages.lib.distributed.trainer`
    does: DeepSpeed's bf16 module as it is, the torch trainer's bf16 under autocast."""

    def __init__(self, model_dir: str, precision: str, lora: bool) -> None:
        from stages.lib.model.lora.wrap import load_trained

        bf16 = precision != "fp32"
        trainer = "torch" if precision == "bf16-autocast" else "deepspeed"
        ds = {"bf16": {"enabled": bf16 and trainer == "deepspeed"}}
        self.autocast = transports.engine_autocast(bf16, trainer)
        self.wire = transports.wire_dtype(bf16, trainer)
        self.lora = LoraBlock(rank=4) if lora else None
        self.module = load_trained(model_dir, ds, self.lora, bf16)
        self.module.train()
        self.trainable = [p for p in self.module.parameters() if p.requires_grad]

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)

    def step(self) -> None:
        """One optimizer step on a batch: every trained weight moves."""
        optim = torch.optim.AdamW(self.trainable, lr=1e-2)
        with self.compute():
            lp, _ = completion_logprobs(self.module, BATCH, "cpu", 1.0, 0)
        (-torch.cat(lp).float().sum()).backward()
        optim.step()
        optim.zero_grad()

    def probe(self) -> list[float]:
        with torch.no_grad(), self.compute():
            lp, _ = completion_logprobs(self.module, [PROBE], "cpu", 1.0, 0)
        return [float(x) for x in lp[0]]

    def synced(self) -> list[tuple[str, Any]]:
        """What the actor sends: every weight, or the adapters alone."""
        if self.lora is None:
            return list(self.module.named_parameters())
        from stages.lib.model.lora.wrap import adapter_params

        return adapter_params(self.module)


class Skips(transports.DiskReceiver):
    """A sync that drops the weights whose names hold any of `skip` (and says nothing)."""

    def __init__(self, name: str, path: str, skip: tuple[str, ...]) -> None:
        super().__init__(name, path)
        self.skip = skip

    def apply(self, model: Any) -> None:
        from safetensors import safe_open

        params = dict(model.named_parameters(remove_duplicate=False))
        with torch.no_grad(), safe_open(self.path, framework="pt") as f:  # type: ignore[no-untyped-call]
            for name in f.keys():  # noqa: SIM118
                if not any(s in name for s in self.skip):
                    params[name].copy_(f.get_tensor(name))


def sync(side: Side, engine: Any, path: Path, skip: tuple[str, ...] = ()) -> None:
    publisher = transports.DiskPublisher(str(path), side.wire)
    publisher.publish(((n, p.data) for n, p in side.synced()), [])
    Skips("local-0", str(path), skip).apply(engine.model)


def engine_for(model_dir: str, side: Side) -> Any:
    from stages.rl.rollout.local import LocalEngine

    bf16 = side.wire == torch.bfloat16 or side.autocast
    return LocalEngine(model_dir, "cpu", bf16, side.lora, side.autocast)


PRECISIONS = ["fp32", "bf16", "bf16-autocast"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_correct_sync_scores_the_probe_exactly_as_the_actor(
    model_dir: str, precision: str, lora: bool, tmp_path: Path
):
    side = Side(model_dir, precision, lora)
    engine = engine_for(model_dir, side)
    assert engine.probe_rule == transports.SAME_FUNCTION
    for step in range(3):
        sync(side, engine, tmp_path / "sync.safetensors")
        theirs = engine.scores(PROBE)["local-0"]
        assert transports.verify("local-0", theirs, side.probe(), engine.probe_rule, step) == 0.0
        side.step()


SABOTAGES = [
    ("full", "stale layer", ("layers.1.",)),
    ("lora", "stale layer", ("layers.1.",)),
    ("lora", "adapters on only some modules", ("mlp.",)),
]


@pytest.mark.parametrize(("weights", "what", "skip"), SABOTAGES, ids=[s[1] for s in SABOTAGES])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_sabotaged_sync_fails_within_one_step(
    model_dir: str, precision: str, weights: str, what: str, skip: tuple[str, ...], tmp_path: Path
):
    side = Side(model_dir, precision, weights == "lora")
    engine = engine_for(model_dir, side)
    path = tmp_path / "sync.safetensors"
    sync(side, engine, path)  # step 0: the engine starts as the actor is
    rule = engine.probe_rule
    assert transports.verify("local-0", engine.scores(PROBE)["local-0"], side.probe(), rule, 0) == 0
    side.step()
    sync(side, engine, path, skip)  # step 1: part of the update never lands
    with pytest.raises(transports.SyncFailed, match=r"^step 1: engine 'local-0' does not match"):
        transports.verify("local-0", engine.scores(PROBE)["local-0"], side.probe(), rule, 1)

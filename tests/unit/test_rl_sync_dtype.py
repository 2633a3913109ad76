"""Weights travel in one dtype both ends know: a bf16 actor into an fp32 engine over a real
gloo group (the actor's rank 0 and the engine in two threads of this process)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny(seed: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _sync(actor: torch.nn.Module, engine: torch.nn.Module, bf16: bool) -> None:
    from stages.rl.sync.transports import GroupPublisher, GroupReceiver, wire_dtype

    wire = wire_dtype(bf16)
    receiver = GroupReceiver("local-0", 30.0, host="127.0.0.1", world=2, wire=wire)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            shapes = [(n, list(p.shape)) for n, p in actor.named_parameters()]
            publisher = GroupPublisher(receiver.address, 30.0, world=2, wire=wire, bucket_mb=1)
            publisher.publish(((n, p.data) for n, p in actor.named_parameters()), shapes)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    receiver.apply(engine)
    sender.join(60)
    assert not errors and not sender.is_alive()


def test_bf16_actor_into_fp32_engine_probe_passes():
    """A bf16 actor's weights arrive exactly in an fp32 engine (vLLM's case in fp32: another
    function, judged as other kernels are)."""
    from stages.rl.algo.logprobs import Sample, completion_logprobs
    from stages.rl.sync.transports import other_kernels, verify

    actor, engine = _tiny(0, torch.bfloat16), _tiny(1, torch.float32)
    _sync(actor, engine, bf16=True)
    for (name, a), (_, e) in zip(actor.named_parameters(), engine.named_parameters(), strict=True):
        assert e.dtype == torch.float32, name
        assert torch.equal(e, a.float()), name  # bf16 values, exactly, in the fp32 engine
    probe = Sample(ids=(1, 5, 9, 2, 7, 3, 11, 4), prompt_len=3)
    with torch.no_grad():
        mine = [float(x) for x in completion_logprobs(actor, [probe], "cpu", 1.0, 0)[0][0]]
        theirs = [float(x) for x in completion_logprobs(engine, [probe], "cpu", 1.0, 0)[0][0]]
    verify("local-0", theirs, mine, other_kernels(bf16=True), 1)


def test_fp32_sync_is_exact():
    actor, engine = _tiny(0, torch.float32), _tiny(1, torch.float32)
    _sync(actor, engine, bf16=False)
    for (_, a), (_, e) in zip(actor.named_parameters(), engine.named_parameters(), strict=True):
        assert torch.equal(a, e)


def test_the_same_function_is_judged_per_token_and_names_the_worst():
    """The local engine computes the actor's function: any token past 1e-6 nats fails, and
    the message names the token; a probe that did not move since the last sync says so."""
    from stages.rl.sync.transports import SAME_FUNCTION, SyncFailed, verify

    actor = [-1.0, -0.5, -1.3]
    assert verify("local-0", list(actor), actor, SAME_FUNCTION, 11) == 0.0
    moved = [-1.0, -0.5004, -1.3]
    with pytest.raises(SyncFailed, match=r"differ by 0\.0004 at token 1 of 3 \(tolerance 1e-06"):
        verify("local-0", moved, actor, SAME_FUNCTION, 11)
    with pytest.raises(SyncFailed, match=r"did not move since the last sync: the weights did not"):
        verify("local-0", moved, actor, SAME_FUNCTION, 11, list(moved))


def test_other_kernels_fp32_every_token_bf16_the_mean_unless_the_engine_moved():
    """vLLM's kernels: fp32 allows no token over 1e-4; bf16 (another function, no per-token
    bound measured) judges the mean, and an engine whose probe moved may keep up to 1 nat."""
    from stages.rl.sync.transports import SyncFailed, other_kernels, verify

    actor = [-3.0, -2.5, -3.3]
    arrived = [-3.3, -2.45, -3.16]  # mean 0.163, worst 0.3
    before = [-3.4, -2.6, -3.1]  # the engine's probe after the previous sync
    bf16, fp32 = other_kernels(True), other_kernels(False)
    assert verify("vllm-0", arrived, actor, bf16, 61, before) == pytest.approx(0.3)
    with pytest.raises(SyncFailed, match=r"mean 0\.163 .*did not move since the last sync"):
        verify("vllm-0", arrived, actor, bf16, 61, list(arrived))
    with pytest.raises(SyncFailed, match=r"the weights did not arrive"):
        verify("vllm-0", arrived, actor, bf16, 61)  # the first sync: nothing to compare
    with pytest.raises(SyncFailed, match=r"mean 1\.5 "):
        verify("vllm-0", [a - 1.5 for a in actor], actor, bf16, 61, before)
    with pytest.raises(SyncFailed, match=r"differ by 0\.3 at token 0 of 3 \(tolerance 0\.0001"):
        verify("vllm-0", arrived, actor, fp32, 61, before)

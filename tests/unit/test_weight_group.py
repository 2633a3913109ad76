"""Weights over a process group in bounded buckets (`stages.lib.distributed.weight_group`), the protocol
the actor speaks to local engines and to vLLM's workers alike: bucket boundaries, a real
gloo broadcast to two receivers at once (every tensor, every alias, in order), and a server
that cannot join the group failing the first sync with both ends named."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")


def test_buckets_are_bounded_ordered_and_a_large_tensor_travels_alone():
    from stages.lib.distributed.weight_group import buckets

    shapes = [("a", [4, 4]), ("b", [8]), ("big", [100]), ("c", [2]), ("d", [3])]
    plan = buckets(shapes, itemsize=4, bucket_bytes=100)  # 25 floats a bucket
    assert [[n for n, _ in b] for b in plan] == [["a", "b"], ["big"], ["c", "d"]]
    assert [n for b in plan for n, _ in b] == [n for n, _ in shapes]
    for bucket in plan:
        size = sum(4 * torch.Size(s).numel() for _, s in bucket)
        assert size <= 100 or len(bucket) == 1


def test_one_broadcast_reaches_two_receivers_with_every_tensor_and_alias():
    import datetime

    import torch.distributed as dist

    from stages.lib.distributed.weight_group import client_store, process_group, receive, send

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30))
    address = f"127.0.0.1:{store.port}"
    torch.manual_seed(0)
    params = [("embed", torch.randn(10, 4)), ("w1", torch.randn(4, 4)), ("w2", torch.randn(300))]
    shapes = [(n, list(t.shape)) for n, t in params]
    got: dict[int, list[tuple[str, torch.Tensor]]] = {1: [], 2: []}
    stats: dict[int, dict[str, float]] = {1: {}, 2: {}}
    errors: list[BaseException] = []

    def receiver(rank: int) -> None:
        try:
            pg = process_group(client_store(address, 3, 30.0), rank, 3, 30.0, False)
            for name, t in receive(pg, "cpu", stats[rank]):
                got[rank].append((name, t.clone()))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    pg = process_group(client_store(address, 3, 30.0), 0, 3, 30.0, False)
    sent = send(
        pg,
        iter(params),
        shapes,
        wire=torch.bfloat16,
        device="cpu",
        bucket_bytes=200,  # 100 bf16 values: three buckets
        aliases={"lm_head": "embed"},
    )
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert sent["bytes"] == sum(t.numel() for _, t in params) * 2
    for rank in (1, 2):
        names = [n for n, _ in got[rank]]
        assert names == ["embed", "lm_head", "w1", "w2"]
        received = dict(got[rank])
        for name, tensor in params:
            assert received[name].dtype == torch.bfloat16
            assert torch.equal(received[name], tensor.to(torch.bfloat16)), name
        assert torch.equal(received["lm_head"], received["embed"])
        assert stats[rank]["bytes"] == sent["bytes"]


class _Servers:
    """A fake pair of vLLM servers (the edge of the world): one worker each; the second
    cannot join the group (its worker cannot reach the rendezvous)."""

    def __init__(self) -> None:
        self.names = ["vllm-0", "vllm-1"]
        self.urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        self.name = ",".join(self.names)

    def post(self, url: str, body: dict | None = None, timeout: float = 600) -> dict:
        from stages.rl.rollout.vllm import EngineFailed

        method = (body or {}).get("method")
        if method == "pipe_sync_info":
            return {"results": [{"rank": 0, "device": "cpu"}]}
        if method == "pipe_sync_join" and url.startswith(self.urls[1]):
            raise EngineFailed(f"{url}: HTTP 500: Connection refused")
        return {"results": [{}]}


def test_a_server_that_cannot_join_fails_the_first_sync_naming_both_ends():
    from stages.rl.sync.transports import SyncFailed
    from stages.rl.sync.vllm import VLLMGroupReceiver

    receiver = VLLMGroupReceiver(_Servers(), "127.0.0.1", 5.0, nccl=False)  # type: ignore[arg-type]
    assert (receiver.world, receiver.bases) == (3, [1, 2])  # actor rank 0, then each worker
    assert receiver.group == {"store": receiver.address, "world": 3}
    with pytest.raises(SyncFailed) as info:
        receiver.apply(None)
    message = str(info.value)
    assert message.startswith("engine 'vllm-1' (http://10.0.0.2:8000): could not join")
    assert f"rendezvous at {receiver.address}" in message and "actor rank 0" in message
    assert "Connection refused" in message and "vllm-0" not in message

"""The rl stage's layout on the placement `pipe plan` prints: what each task of the guide's
70B 1:1:1 on 6 x 8 GPUs starts (ranks per role, engines per worker), computed by the very
functions the run uses, so no refusal is left for run time on that placement."""

from __future__ import annotations

import json
import logging

from engine.stage import Slot, StageContext
from stages.lib.backends.vllm.backend import VLLMBackend
from stages.lib.backends.vllm.server import device_slices
from stages.rl.roles.layout import local_ranks, role_table, role_workers, worker_host
from tests.conftest import ROOT, run_cli


def _contexts(pipeline: str, cluster: str) -> tuple[list[StageContext], dict]:
    result = run_cli("plan", pipeline, "--cluster", cluster, "--format", "json", cwd=ROOT)
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    workers = {}  # a declared cluster has no addresses: one made-up worker per node
    slots = []
    for p in plan["placement"]["ppo"]:
        worker = workers.setdefault(p["node"], f"tcp://10.0.0.{len(workers) + 1}:40000")
        slots.append(Slot(p["node"], worker, tuple(p["devices"]), p["role"]))
    tasks = len(dict.fromkeys((s.node, s.worker) for s in slots))
    contexts = [
        StageContext(
            "ppo",
            "rl",
            "/tmp/x",
            "/tmp",
            "/tmp",
            slots=tuple(slots),
            node_rank=i,
            log=logging.getLogger("t"),
        )
        for i in range(tasks)
    ]
    return contexts, plan["stages"]["ppo"]["config"]


def test_the_70b_example_starts_every_role_on_two_nodes_and_two_engines_of_eight_gpus(
    monkeypatch,
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    contexts, config = _contexts("pipelines/rl_70b_cluster.yaml", "6x8x80GB")
    assert len(contexts) == 6  # one task per node: the controller and five others
    started = {}
    for ctx in contexts:
        for role in ("actor", "critic"):
            ranks = local_ranks(ctx, role, num_processes=1)
            if ranks is not None:
                started.setdefault(role, []).append(
                    (ranks.first, ranks.count, ranks.world, ranks.node_rank, ranks.devices)
                )
    for role in ("actor", "critic"):
        assert started[role] == [
            (0, 8, 16, 0, tuple(str(d) for d in range(8))),
            (8, 8, 16, 1, tuple(str(d) for d in range(8))),
        ]
        assert [r["rank"] for r in role_table(contexts[0], role)] == list(range(16))
    backend = VLLMBackend.model_validate(config["backend"])
    assert (backend.vllm_num_engines, backend.engine_size) == (2, 8)  # tp 4 x pp 2
    engines = [
        device_slices(backend, 8, [str(d) for d in ctx.devices("vllm")])
        for ctx in contexts
        if ctx.node_slots("vllm")
    ]
    assert engines == [[[str(d) for d in range(8)]]] * 2
    assert sum(len(e) for e in engines) == backend.vllm_num_engines
    assert contexts[0].node_slots("vllm")  # the controller sits with the first engines
    assert [worker_host(w) for w in role_workers(contexts[0], "vllm")] == ["10.0.0.1", "10.0.0.2"]


def test_the_70b_example_explain_shows_each_role_on_two_nodes_the_engines_and_the_reference():
    result = run_cli(
        "plan", "pipelines/rl_70b_cluster.yaml", "--cluster", "6x8x80GB", "--explain", cwd=ROOT
    )
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert (
        "backend.vllm_num_engines             2  <- rule: 16 GPUs of role 'vllm' / "
        "tensor-parallel size 4 x pipeline-parallel size 2" in text
    )
    for role, nodes in (("vllm", (0, 1)), ("actor", (2, 3)), ("critic", (4, 5))):
        for n in nodes:
            assert f"  node node{n}: 8 GPUs\n    role {role:<24}devices 0-7\n" in text
    assert "  ppo (ref in actor's ranks): 13.0 GB (weights 13.0 GB); host 0.0 GB\n" in text
    assert "  ppo on node2: 846.6 GB (actor 8 x 105.8 GB, ref 8 x 0.0 GB)\n" in text

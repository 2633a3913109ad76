"""The placement solver: pools, tensor-parallel groups per node, colocation, the DAG, errors."""

from __future__ import annotations

import logging

import pytest

from engine.plan.placement import (
    ClusterView,
    Placement,
    PlacementError,
    Pool,
    RoleRequest,
    StageRequest,
    Worker,
    solve,
)
from engine.plan.topology import view_from_workers
from engine.stage import Slot
from tests.conftest import stub_checkpoint


def nodes(n: int, gpus: int = 8) -> ClusterView:
    return ClusterView(tuple(Worker(None, f"node{i}", tuple(range(gpus))) for i in range(n)), gpus)


def stage(name: str, gpus: int, role: str | None = None, unit: int = 1) -> StageRequest:
    return StageRequest(name, (RoleRequest(role, gpus, unit),))


def where(p: Placement, name: str) -> list[tuple[str, tuple[int, ...], str | None]]:
    return [(s.node, s.devices, s.role) for s in p.stages[name]]


def test_1_1_1_at_48_gpus_gives_each_role_two_whole_nodes_and_keeps_tp_groups_in_a_node():
    pools = [Pool(("vllm",), 16), Pool(("actor",), 16), Pool(("critic",), 16)]
    stages = [
        stage("gen", 16, "vllm", unit=2),
        stage("train", 16, "actor"),
        stage("value", 16, "critic"),
    ]
    p = solve(stages, {"train": ["gen"], "value": ["gen"]}, pools, nodes(6))
    assert where(p, "gen") == [
        ("node0", tuple(range(8)), "vllm"),
        ("node1", tuple(range(8)), "vllm"),
    ]
    assert where(p, "train") == [
        ("node2", tuple(range(8)), "actor"),
        ("node3", tuple(range(8)), "actor"),
    ]
    assert where(p, "value") == [
        ("node4", tuple(range(8)), "critic"),
        ("node5", tuple(range(8)), "critic"),
    ]
    assert p.waits == {}


def test_a_tensor_parallel_group_never_spans_nodes():
    # two nodes with 6 devices each: 8 GPUs in groups of 4 are 4 + 4, never 6 + 2
    six = tuple(range(6))
    cluster = ClusterView((Worker(None, "a", six), Worker(None, "b", six)), 8)
    p = solve([stage("gen", 8, None, unit=4)], {}, [], cluster)
    assert [(s.node, s.devices) for s in p.stages["gen"]] == [
        ("a", (0, 1, 2, 3)),
        ("b", (0, 1, 2, 3)),
    ]
    with pytest.raises(PlacementError) as info:
        solve([stage("gen", 12, None, unit=4)], {}, [], cluster)
    assert info.value.problems == [
        (
            "gen",
            "asks for 12 GPUs in tensor-parallel groups of 4, each on one node; 8 of the 12 "
            "GPUs it may use can be grouped so",
        )
    ]


def test_tp_3_on_8_gpu_nodes_is_refused_with_the_sizes_that_fit():
    with pytest.raises(PlacementError) as info:
        solve([stage("gen", 6, "vllm", unit=3)], {}, [Pool(("vllm",), 6)], nodes(1))
    assert (
        "gen",
        "tensor-parallel size 3 does not fit on a node of 8 GPUs; a tensor-parallel "
        "group never spans nodes: use 1, 2, 4, 8",
    ) in info.value.problems


def test_colocated_roles_share_devices_and_other_roles_do_not():
    pools = [Pool(("vllm",), 4), Pool(("actor", "ref"), 4)]
    rl = StageRequest(
        "rl", (RoleRequest("vllm", 4), RoleRequest("actor", 4), RoleRequest("ref", 4))
    )
    p = solve([rl], {}, pools, nodes(1))
    assert where(p, "rl") == [
        ("node0", (0, 1, 2, 3), "vllm"),
        ("node0", (4, 5, 6, 7), "actor"),
        ("node0", (4, 5, 6, 7), "ref"),
    ]


def test_parallel_branches_get_disjoint_devices_and_a_chain_reuses_them():
    stages = [stage("prep", 4), stage("left", 4), stage("right", 4), stage("join", 8)]
    needs = {"left": ["prep"], "right": ["prep"], "join": ["left", "right"]}
    p = solve(stages, needs, [], nodes(1))
    assert where(p, "left") == [("node0", (0, 1, 2, 3), None)]
    assert where(p, "right") == [("node0", (4, 5, 6, 7), None)]
    assert where(p, "prep") == [("node0", (0, 1, 2, 3), None)]  # before both: reused
    assert where(p, "join") == [("node0", tuple(range(8)), None)]  # after both: reused
    assert p.waits == {}


def test_a_third_independent_stage_on_a_two_gpu_worker_waits_and_reuses_a_device():
    cluster = ClusterView((Worker("tcp://w:1", "n0", (0, 1)),), 2)
    p = solve([stage("a", 1), stage("b", 1), stage("c", 1)], {}, [], cluster)
    assert [p.stages[n][0].devices for n in "abc"] == [(0,), (1,), (0,)]
    assert p.waits == {"c": ("a",)}


def test_workers_of_one_host_are_separate_slots_of_one_node():
    info = {
        "tcp://127.0.0.1:2": {
            "host": "127.0.0.1",
            "resources": {"GPU": 2},
            "env": {"PIPE_NODE": "n0", "CUDA_VISIBLE_DEVICES": "2,3"},
        },
        "tcp://127.0.0.1:1": {
            "host": "127.0.0.1",
            "resources": {"GPU": 2},
            "env": {"PIPE_NODE": "n0", "CUDA_VISIBLE_DEVICES": "0,1"},
        },
        "tcp://127.0.0.1:3": {"host": "127.0.0.1", "resources": {}, "env": {}},
    }
    view = view_from_workers(info, gpus_per_node=4)
    assert [(w.node, w.address, w.devices) for w in view.workers] == [
        ("127.0.0.1", "tcp://127.0.0.1:3", ()),
        ("n0", "tcp://127.0.0.1:1", (0, 1)),
        ("n0", "tcp://127.0.0.1:2", (2, 3)),
    ]
    p = solve([stage("train", 4, "actor")], {}, [Pool(("actor",), 4)], view)
    assert p.stages["train"] == (
        Slot("n0", "tcp://127.0.0.1:1", (0, 1), "actor"),
        Slot("n0", "tcp://127.0.0.1:2", (2, 3), "actor"),
    )


def test_uuid_device_names_fall_back_to_indices():
    info = {
        "tcp://h:1": {
            "host": "h",
            "resources": {"GPU": 2},
            "env": {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"},
        }
    }
    assert view_from_workers(info, 8).workers[0].devices == (0, 1)


def test_more_gpus_than_the_cluster_offers_names_both_figures():
    with pytest.raises(PlacementError) as info:
        solve([stage("t", 16, "actor")], {}, [Pool(("actor",), 16)], nodes(1), declared=16)
    assert info.value.problems == [
        ("", "the pipeline asks for 16 GPUs (cluster.gpus); the workers offer 8 (1 node(s) x 8)")
    ]


def test_a_stage_larger_than_its_role_is_refused():
    with pytest.raises(PlacementError) as info:
        solve([stage("t", 8, "actor")], {}, [Pool(("vllm",), 4), Pool(("actor",), 4)], nodes(1))
    assert info.value.problems == [("t", "asks for 8 GPUs; role 'actor' has 4")]


def test_the_same_input_gives_the_same_placement_and_the_text_table():
    pools = [Pool(("vllm",), 8), Pool(("actor",), 8)]
    stages = [stage("gen", 8, "vllm", unit=2), stage("train", 8, "actor")]
    first = solve(stages, {"train": ["gen"]}, pools, nodes(2))
    assert first == solve(stages, {"train": ["gen"]}, pools, nodes(2))
    assert first.render_text(nodes(2)) == (
        "placement on 2 node(s) x 8 GPUs (gpus_per_node 8):\n"
        "  node node0: 8 GPUs\n"
        "    role vllm                    devices 0-7\n"
        "    gen (vllm)                   devices 0-7\n"
        "  node node1: 8 GPUs\n"
        "    role actor                   devices 0-7\n"
        "    train (actor)                devices 0-7\n"
    )
    assert first.as_dict()["gen"] == [
        {"node": "node0", "worker": None, "devices": list(range(8)), "role": "vllm"}
    ]


def test_validate_with_a_declared_cluster_gives_a_located_error(tmp_path, monkeypatch):
    from tests.conftest import run_cli

    monkeypatch.chdir(tmp_path)
    stub_checkpoint(tmp_path / "m1")
    (tmp_path / "p.yaml").write_text(
        "name: p\n"
        "cluster: {gpus: 16, gpus_per_node: 8}\n"
        "stages:\n"
        "  t:\n"
        "    kind: train\n"
        "    resources: {gpus: 16}\n"
        "    config: {input: d.jsonl, model: m1, micro_train_batch_size: 4}\n"
    )
    (tmp_path / "c.yaml").write_text("nodes: 1\ngpus_per_node: 8\ngpu_memory_gb: 80\n")
    result = run_cli("validate", "p.yaml", "--cluster", "c.yaml")
    assert result.exit_code == 2
    assert result.stderr == (
        "p.yaml:2:17: cluster.gpus: the pipeline asks for 16 GPUs (cluster.gpus); the workers "
        "offer 8 (1 node(s) x 8)\n"
    )
    assert run_cli("validate", "p.yaml", "--cluster", "2x8").exit_code == 0


def test_a_cluster_file_error_is_located(tmp_path):
    from engine.errors import PipeError
    from engine.plan.topology_file import load_cluster_file

    path = tmp_path / "c.yaml"
    path.write_text("nodes: 2\ngpus_per_nod: 8\n")
    with pytest.raises(PipeError) as info:
        load_cluster_file(str(path))
    assert info.value.render() == (
        f"{path}:2:1: gpus_per_nod: unknown field 'gpus_per_nod'; did you mean 'gpus_per_node'?"
    )
    view = load_cluster_file("6x8x80GB")
    assert (len(view.workers), view.gpus_per_node, view.gpu_memory_bytes) == (6, 8, 80 * 10**9)


def test_the_live_view_keeps_each_workers_gpu_and_host_memory(caplog):
    info = {
        "tcp://a:1": {
            "host": "a",
            "resources": {"GPU": 8},
            "env": {"GPU_MEMORY_MIB": "81559", "HOST_MEMORY_BYTES": str(2 * 10**12)},
        },
        "tcp://b:1": {"host": "b", "resources": {"GPU": 8}, "env": {"GPU_MEMORY_MIB": "40960"}},
        "tcp://c:1": {"host": "c", "resources": {"GPU": 2}, "env": {"GPU_MEMORY_MIB": None}},
    }
    with caplog.at_level(logging.DEBUG, logger="pipe.placement"):
        view = view_from_workers(info, 8)
    assert view.gpu_memory("a", "tcp://a:1") == 81559 * 2**20
    assert view.gpu_memory("b", "tcp://b:1") == 40960 * 2**20
    assert view.gpu_memory("c", "tcp://c:1") is None  # unread: not checked, never guessed
    assert (view.host_memory("a"), view.host_memory("b")) == (2 * 10**12, None)
    assert view.gpu_memory_by_node() == {"a": 81559 * 2**20, "b": 40960 * 2**20, "c": None}
    assert [r.getMessage() for r in caplog.records] == [
        "worker tcp://b:1: its host memory could not be read; it is not checked",
        "worker tcp://c:1: its GPU memory (nvidia-smi) could not be read; it is not checked",
        "worker tcp://c:1: its host memory could not be read; it is not checked",
    ]


def test_a_chain_of_3000_stages_listed_last_first_places_without_waits():
    # each stage needs the one before it: none runs beside another, so all may share
    # node0; the needs are given last stage first (a recursive walk would go 3000 deep)
    names = [f"s{i}" for i in range(3000)]
    needs = {names[i]: [names[i - 1]] for i in reversed(range(1, 3000))}
    p = solve([stage(n, 8) for n in names], needs, [], nodes(2))
    assert {where(p, n)[0][0] for n in names} == {"node0"}
    assert p.waits == {}


def test_a_stage_beside_a_chain_takes_the_other_node_and_the_chain_keeps_its_own():
    names = ["a", "b", "c"]
    needs = {"b": ["a"], "c": ["b"], "x": []}
    p = solve([stage("x", 8), *(stage(n, 8) for n in names)], needs, [], nodes(2))
    assert where(p, "x") == [("node0", tuple(range(8)), None)]
    assert {where(p, n)[0][0] for n in names} == {"node1"}
    assert p.waits == {}


def test_colocated_roles_ask_dask_for_each_device_once():
    """`colocate: all` on one GPU: the vllm and actor slots name the same device; the task
    asks the worker for 1 GPU, not 2 (a worker offering GPU=1 never ran it: the rl stage
    waited forever on the first real GPU run)."""
    from engine.run.execute import held_gpus

    w, other = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"
    slots = (
        Slot("n0", w, (0,), "vllm"),
        Slot("n0", w, (0,), "actor"),
        Slot("n0", other, (0, 1), "critic"),
    )
    assert held_gpus(slots, w) == 1
    assert held_gpus(slots, other) == 2
    assert held_gpus((*slots[:2], Slot("n0", w, (1,), "ref")), w) == 2

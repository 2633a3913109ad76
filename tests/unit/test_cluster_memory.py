"""Every figure of a cluster acts: each node's GPU memory and host memory, declared in a
cluster file or read from the live workers, checked against the placed stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import PipeError
from engine.load.load import load_pipeline
from engine.plan.dag import plan
from engine.plan.topology import view_from_workers
from engine.resolve.resolve import resolve
from tests.conftest import run_cli
from tests.unit.test_memory import LLAMA

# a 7B full fine-tune without activation checkpointing: 53.6 GB per GPU on 16 GPUs
SFT_7B = (
    "name: ft7b\n"
    "cluster: {gpus: 16, gpus_per_node: 8}\n"
    "stages:\n"
    "  sft:\n"
    "    kind: train\n"
    "    resources: {role: actor}\n"
    "    config: {input: d.jsonl, model: llama7b, bf16: true, train_batch_size: 64,\n"
    "             micro_train_batch_size: 1, max_length: 2048, zero_stage: 2,\n"
    "             gradient_checkpointing: false}\n"
)
# a 70B full fine-tune, ZeRO-3 with adam_offload: 103.5 GB of host memory per GPU
SFT_70B = (
    "name: ft70b\n"
    "memory: memory_constrained\n"
    "cluster: {gpus: 16, gpus_per_node: 8}\n"
    "stages:\n"
    "  sft:\n"
    "    kind: train\n"
    "    resources: {role: actor}\n"
    "    config: {input: d.jsonl, model: llama70b, bf16: true, train_batch_size: 64,\n"
    "             micro_train_batch_size: 2, max_length: 2048}\n"
)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for name in ("7B", "70B"):
        (tmp_path / f"llama{name.lower()}").mkdir()
        (tmp_path / f"llama{name.lower()}" / "config.json").write_text(json.dumps(LLAMA[name]))
    (tmp_path / "p7.yaml").write_text(SFT_7B)
    (tmp_path / "p70.yaml").write_text(SFT_70B)
    return tmp_path


def nodes_file(path: Path, sizes: list[int | None], host_gb: int = 1024) -> str:
    """A cluster file: one node per entry of `sizes` (its gpu_memory_gb, None: the file's 80)."""
    lines = ["nodes:"]
    for i, size in enumerate(sizes):
        own = f", gpu_memory_gb: {size}" if size is not None else ""
        lines.append(f"  - {{name: n{i}{own}}}")
    lines += ["gpus_per_node: 8", "gpu_memory_gb: 80", f"host_memory_gb: {host_gb}"]
    path.write_text("\n".join(lines) + "\n")
    return str(path.name)


def test_a_role_on_a_40gb_node_is_refused_at_the_stage_with_the_cheapest_change(project):
    # the actor's pool takes whole nodes in order: n0 (40 GB) and n1
    refused = run_cli(
        "validate", "p7.yaml", "--cluster", nodes_file(project / "c.yaml", [40, None])
    )
    assert refused.exit_code == 2
    assert refused.stderr == (
        "p7.yaml:6:16: stages.sft: needs 53.6 GB per GPU (actor: weights 13.5 GB, gradients "
        "2.5 GB, optimizer 5.1 GB, activations 30.9 GB, buffers 1.7 GB), the GPUs of node 'n0' "
        "have 40.0 GB; changes that fit, cheapest first: `gradient_checkpointing: true` -> "
        "24.5 GB\n"
    )


def test_the_same_nodes_accept_the_role_where_it_lands_only_on_80gb_nodes(project):
    cluster = nodes_file(project / "c.yaml", [None, None, 40])  # n2 (40 GB) holds nothing
    accepted = run_cli("validate", "p7.yaml", "--cluster", cluster)
    assert (accepted.exit_code, accepted.stderr) == (0, "")
    explained = run_cli("plan", "p7.yaml", "--cluster", cluster, "--explain").stdout
    tail = explained[explained.index("memory per GPU") :]
    assert tail == (
        "memory per GPU (n0 80.0 GB, n1 80.0 GB, n2 40.0 GB):\n"
        "  sft (actor): 53.6 GB (weights 13.5 GB, gradients 2.5 GB, optimizer 5.1 GB, "
        "activations 30.9 GB, buffers 1.7 GB); host 40.4 GB\n"
        "host memory per node:\n"
        "  sft on n0: 323.4 GB of 1024.0 GB (actor 8 x 40.4 GB)\n"
        "  sft on n1: 323.4 GB of 1024.0 GB (actor 8 x 40.4 GB)\n"
    )


def test_host_memory_is_refused_on_64gb_hosts_and_accepted_on_1tb(project):
    refused = run_cli(
        "validate", "p70.yaml", "--cluster", nodes_file(project / "c.yaml", [None] * 2, 64)
    )
    assert refused.exit_code == 2
    # no change fits: without offload the GPUs overflow, and 26 nodes would need a larger
    # train_batch_size than 64 for their 208 ranks
    assert refused.stderr == (
        "p70.yaml:7:16: stages.sft: needs 827.7 GB of host memory on nodes 'n0', 'n1' "
        "(actor: 8 ranks x 103.5 GB), each has 64.0 GB; changes that fit, cheapest first: "
        "none found\n"
    )
    bigger = run_cli(
        "validate", "p70.yaml", "--cluster", nodes_file(project / "c.yaml", [None] * 2, 512)
    )
    assert bigger.exit_code == 2
    assert bigger.stderr == (
        "p70.yaml:7:16: stages.sft: needs 827.7 GB of host memory on nodes 'n0', 'n1' "
        "(actor: 8 ranks x 103.5 GB), each has 512.0 GB; changes that fit, cheapest first: "
        "`cluster.gpus: 32` on 4 nodes like these -> 413.9 GB\n"
    )
    cluster = nodes_file(project / "c.yaml", [None] * 2, 1024)
    accepted = run_cli("validate", "p70.yaml", "--cluster", cluster)
    assert (accepted.exit_code, accepted.stderr) == (0, "")
    planned = json.loads(
        run_cli("plan", "p70.yaml", "--cluster", cluster, "--format", "json").stdout
    )
    actor = planned["memory"]["sft"]["actor"]
    assert actor["host_bytes"] == 103_464_972_288  # DeepSpeed: 16 bytes x P / 2 nodes x 1.5 / 8
    assert actor["nodes"] == {
        n: {"ranks": 8, "host_bytes": 8 * actor["host_bytes"]} for n in ("n0", "n1")
    }


def test_a_host_between_90_and_100_percent_full_is_a_warning(project):
    warned = run_cli(
        "validate", "p70.yaml", "--cluster", nodes_file(project / "c.yaml", [None] * 2, 900)
    )
    assert warned.exit_code == 0
    assert warned.stderr == (
        "p70.yaml:7:16: warning: stages.sft: needs 827.7 GB of host memory on nodes 'n0', "
        "'n1', 92% of 900.0 GB: little headroom\n"
    )


def test_a_live_cluster_checks_each_workers_gpus_and_skips_what_it_could_not_read(project):
    loaded = load_pipeline("p7.yaml")

    def worker(node: str, mib: str | None, host: str | None) -> dict[str, object]:
        env = {"PIPE_NODE": node, "GPU_MEMORY_MIB": mib, "HOST_MEMORY_BYTES": host}
        return {"host": "h", "resources": {"GPU": 8}, "env": env}

    big, small, tb = str(81920), str(40960), str(10**12)
    fits = view_from_workers(
        {"tcp://a:1": worker("a", big, tb), "tcp://b:1": worker("b", big, tb)}, 8
    )
    assert plan(resolve(loaded), fits).memory is not None
    short = view_from_workers(
        {"tcp://a:1": worker("a", small, tb), "tcp://b:1": worker("b", big, tb)}, 8
    )
    with pytest.raises(PipeError) as info:
        plan(resolve(loaded), short)
    assert "the GPUs of node 'a' have 42.9 GB" in info.value.render()
    unread = view_from_workers(
        {"tcp://a:1": worker("a", None, None), "tcp://b:1": worker("b", big, None)}, 8
    )
    planned = plan(resolve(loaded), unread)  # node a's GPUs unread: not checked, not guessed
    assert planned.memory is not None and "sft" in planned.memory


def test_a_dask_worker_reports_its_hosts_memory():
    import psutil
    from distributed import Client, LocalCluster

    from engine.cluster.connect import Cluster

    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as local,
        Client(local) as client,
    ):
        view = view_from_workers(Cluster(client).worker_info(), 8)
    (node,) = view.nodes()
    assert view.host_memory(node) == psutil.virtual_memory().total


def test_dpo_reference_counted_in_memory_plan(project):
    """DPO's ranks each load the frozen reference whole, in fp32, on their device: the plan
    counts it beside the policy (it was counted nowhere, so a DPO run fit on paper only):
    the 7B fine-tune that fits in 53.6 GB needs 27.0 GB more with DPO and is refused."""
    (project / "dpo.yaml").write_text(
        SFT_7B.replace("ft7b", "dpo7b").replace(
            "model: llama7b,", "model: llama7b, algorithm: dpo, target: completion,"
        )
    )
    cluster = nodes_file(project / "c.yaml", [None, None])
    assert run_cli("validate", "p7.yaml", "--cluster", cluster).exit_code == 0
    refused = run_cli("validate", "dpo.yaml", "--cluster", cluster)
    assert refused.exit_code == 2
    assert refused.stderr.startswith(
        "dpo.yaml:6:16: stages.sft: needs 80.6 GB per GPU (actor: weights 13.5 GB, gradients "
        "2.5 GB, optimizer 5.1 GB, activations 30.9 GB, buffers 1.7 GB; dpo_reference: weights "
        "27.0 GB), the GPUs have 80.0 GB"
    ), refused.stderr

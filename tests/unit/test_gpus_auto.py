"""`cluster.gpus: auto`: the quickstarts on this machine's GPUs when it shows some, on the CPU
otherwise, with no edits; `pipe plan` says which, and from where."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, run_cli

GRPO = "pipelines/grpo_quickstart.yaml"


def plan(monkeypatch: pytest.MonkeyPatch, visible: str, *args: str):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return run_cli("plan", *args, cwd=ROOT)


def test_no_gpu_visible_runs_every_stage_on_the_cpu(monkeypatch: pytest.MonkeyPatch):
    result = plan(monkeypatch, "", GRPO, "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == (
        "pipelines/grpo_quickstart.yaml:15:9: note: cluster.gpus: auto -> 0 (no GPU visible on "
        "this machine, by CUDA_VISIBLE_DEVICES): stages run on the CPU (warmup, grpo, evaluate "
        "would take GPUs)\n"
    )
    stages = json.loads(result.stdout)["stages"]
    assert {n: s["resources"]["gpus"] for n, s in stages.items()} == dict.fromkeys(stages, 0)


def test_one_visible_gpu_holds_warmup_grpo_and_evaluate(monkeypatch: pytest.MonkeyPatch):
    result = plan(monkeypatch, "0", GRPO, "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "pipelines/grpo_quickstart.yaml:15:9: note: cluster.gpus: auto -> 1 (visible on this "
        "machine, by CUDA_VISIBLE_DEVICES): warmup, grpo, evaluate on GPU 0"
    )
    placement = json.loads(result.stdout)["placement"]
    assert {
        n: sorted({d for s in slots for d in s["devices"]}) for n, slots in placement.items()
    } == {
        "warmup": [0],
        "grpo": [0],
        "evaluate": [0],
    }
    assert {s["role"] for s in placement["grpo"]} == {"vllm", "actor"}  # colocated on GPU 0


def test_explain_says_what_auto_came_to(monkeypatch: pytest.MonkeyPatch):
    text = plan(monkeypatch, "3", "pipelines/quickstart.yaml", "--explain").stdout
    assert "cluster: local, 2 workers, auto -> 1 GPUs (visible on this machine, by " in text
    assert text.rstrip().endswith(
        "pipelines/quickstart.yaml:13:9: note: cluster.gpus: auto -> 1 (visible on this machine, "
        "by CUDA_VISIBLE_DEVICES): warmup, collect, rft, evaluate on GPU 3"
    )


def test_a_declared_cluster_overrides_this_machine(monkeypatch: pytest.MonkeyPatch):
    result = plan(monkeypatch, "", GRPO, "--cluster", "1x2x80GB")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "pipelines/grpo_quickstart.yaml:15:9: note: cluster.gpus: auto -> 2 (from --cluster "
        "1x2x80GB): warmup, evaluate on GPU 0; grpo on GPUs 0, 1"
    )


def test_the_live_workers_gpus_place_the_stages():
    """What `pipe run` does once connected: the workers' `GPU` resources (a worker started
    with `--resources GPU=1`) are the count, and the stages are placed on them."""
    from engine.load.load import load_pipeline
    from engine.plan.dag import plan as place
    from engine.plan.topology import view_from_workers
    from engine.resolve.resolve import resolve

    info = {"tcp://127.0.0.1:1": {"host": "127.0.0.1", "resources": {"GPU": 1}, "env": {}}}
    view = view_from_workers(info, 8)
    loaded = load_pipeline(str(ROOT / GRPO))
    source = "from the workers' resources"
    placed = place(resolve(loaded, gpus=len(view.devices()), gpus_from=source), view)
    assert placed.placement is not None
    assert {n: s[0].worker for n, s in placed.placement.stages.items()} == {
        "warmup": "tcp://127.0.0.1:1",
        "grpo": "tcp://127.0.0.1:1",
        "evaluate": "tcp://127.0.0.1:1",
    }
    none = {"tcp://127.0.0.1:1": {"host": "127.0.0.1", "resources": {}, "env": {}}}
    cpu = place(resolve(loaded, gpus=0, gpus_from=source), view_from_workers(none, 8))
    assert cpu.placement is not None and not cpu.placement.stages
    assert [n.message for n in cpu.resolved.notes][-1] == (
        "auto -> 0 (from the workers' resources): stages run on the CPU (warmup, grpo, "
        "evaluate would take GPUs)"
    )


def test_an_explicit_cpu_cluster_still_refuses_a_gpu_stage(monkeypatch: pytest.MonkeyPatch):
    result = plan(monkeypatch, "0", GRPO, "--set", "cluster.gpus=0")
    assert result.exit_code == 2
    assert "stages.warmup.resources: asks for 1 GPUs; the cluster has 0 (cluster.gpus)" in (
        result.stderr
    )

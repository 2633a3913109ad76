"""`vllm_pipeline_parallel_size`: an engine of tensor-parallel size x pipeline stages GPUs,
planned on one node (pipe starts an engine as one process tree on its worker), started with
vLLM's `--pipeline-parallel-size`, its devices one slice per engine."""

from __future__ import annotations

from pathlib import Path

from stages.lib.backends.vllm.backend import VLLMBackend
from stages.lib.backends.vllm.server import device_slices, server_command
from tests.conftest import ROOT, run_cli

EXAMPLE = (ROOT / "pipelines/rl_70b_cluster.yaml").read_text()


def with_engine(tmp_path: Path, tp: int, pp: int) -> str:
    text = EXAMPLE.replace(
        "vllm_tensor_parallel_size: 4 ", f"vllm_tensor_parallel_size: {tp} "
    ).replace("vllm_pipeline_parallel_size: 2 ", f"vllm_pipeline_parallel_size: {pp} ")
    (tmp_path / "models").symlink_to(ROOT / "pipelines/models")
    (tmp_path / "p.yaml").write_text(text)
    return "p.yaml"


def test_engines_are_counted_in_tensor_times_pipeline_gpus_and_started_with_both():
    # the 70B example's explain: tests/unit/test_rl_layout.py
    backend = VLLMBackend(
        kind="vllm",
        model="m",
        vllm_num_engines=2,
        vllm_tensor_parallel_size=2,
        vllm_pipeline_parallel_size=2,
    )
    assert device_slices(backend, 8, [str(d) for d in range(8)]) == [
        ["0", "1", "2", "3"],
        ["4", "5", "6", "7"],
    ]
    cmd = server_command(backend, python="python", port=8000, gpus=4)
    at = cmd.index("--pipeline-parallel-size")
    assert cmd[at + 1] == "2" and cmd[cmd.index("--tensor-parallel-size") + 1] == "2"


def test_an_engine_larger_than_a_node_is_refused_with_the_sizes_that_fit(tmp_path: Path):
    result = run_cli("validate", with_engine(tmp_path, 4, 4), "--cluster", "6x8x80GB", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "p.yaml:30:38: stages.ppo.config.backend.vllm_pipeline_parallel_size: tensor-parallel "
        "size 4 x pipeline-parallel size 4 = 16 GPUs per engine does not fit on a node of 8 "
        "GPUs (cluster.gpus_per_node): pipe starts an engine on one node (vLLM's multi-process "
        "executor; an engine across nodes needs a Ray cluster, which pipe does not start): "
        "use 1, 2"
    ]

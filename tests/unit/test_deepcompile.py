"""`deepcompile` (train and rl, beside `zero_stage`): DeepSpeed's compiler in the trainer's
ds_config, refused at plan where DeepSpeed has none (the CPU, the plain torch trainer). The run
on CUDA is tests/integration/test_gpu_deepcompile.py (marked `gpu`)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

from stages.lib.distributed.ds_config import build_ds_config
from tests.conftest import run_cli

PIPELINE = """\
    name: dc
    cluster: {{scheduler: local, workers: 1, gpus: {cluster}, gpus_per_node: {node}}}
    stages:
      data:
        kind: dataset
        config: {{task: chain_sum, size: 64, test_size: 8}}
      sft:
        kind: train
        needs: [data]
        resources: {{gpus: {gpus}}}
        config: {{target: answer, model: {{hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 512}}, deepcompile: true{extra}}}
      rl:
        kind: rl
        needs: [data, sft]
        config: {{input: "@data", model: "@sft", deepcompile: true}}
"""


def write(tmp_path: Path, gpus: int, extra: str = "") -> None:
    text = PIPELINE.format(gpus=gpus, cluster=2 * gpus, node=max(2 * gpus, 1), extra=extra)
    text = textwrap.dedent(text)
    (tmp_path / "p.yaml").write_text(text)


def test_on_the_cpu_it_is_refused_where_it_is_set(tmp_path: Path):
    write(tmp_path, 0)
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2, result.output
    why = (
        "DeepSpeed's DeepCompile runs on CUDA only (torch >= 2.6 and the CUDA accelerator); "
        "this stage runs on the CPU (no GPUs: cluster.gpus, resources.gpus): remove it"
    )
    assert result.stderr.splitlines() == [
        f"p.yaml:11:115: stages.sft.config.deepcompile: {why}",
        f"p.yaml:15:58: stages.rl.config.deepcompile: {why}",
    ]


def test_on_a_gpu_it_needs_deepspeeds_engine_and_is_explained(tmp_path: Path):
    write(tmp_path, 1, ", trainer: torch")
    refused = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert refused.exit_code == 2
    assert refused.stderr.splitlines() == [
        "p.yaml:11:115: stages.sft.config.deepcompile: DeepCompile compiles DeepSpeed's engine, "
        "and trainer: torch trains without one: use trainer deepspeed, or remove deepcompile"
    ]
    write(tmp_path, 1)
    assert run_cli("validate", "p.yaml", cwd=tmp_path).exit_code == 0
    explained = run_cli("plan", "p.yaml", "--explain", cwd=tmp_path).stdout
    assert [line.split()[:2] for line in explained.splitlines() if "deepcompile" in line] == [
        ["deepcompile", "true"],
        ["deepcompile", "true"],
    ]


def test_the_ds_config_asks_deepspeed_to_compile():
    cfg = SimpleNamespace(
        zero_stage=1,
        overlap_comm=False,
        adam_offload=False,
        micro_train_batch_size=4,
        train_batch_size=8,
        bf16=True,
        deepcompile=True,
    )
    assert build_ds_config(cfg, 2)["compile"] == {"deepcompile": True}  # type: ignore[arg-type]
    cfg.deepcompile = False
    assert "compile" not in build_ds_config(cfg, 2)  # type: ignore[arg-type]

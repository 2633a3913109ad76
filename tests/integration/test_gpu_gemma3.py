"""On one GPU: the real model end to end, pipelines/gemma3_grpo.yaml shrunk to a short SFT,
20 GRPO steps (LoRA, the in-process engine, and vLLM's engine where one is installed) and the
evaluate of the base, SFT and GRPO checkpoints on the 200 held-out prompts. Skipped without
CUDA or without the GGUF file (`make gemma3` writes models/gemma-3-270m-q4_k_m.gguf; `make
gpu-check` runs this test where the file is there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.gpu(count=1), pytest.mark.integration, pytest.mark.slow]

GGUF = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
SHRUNK = {  # a short SFT (format and answers), 20 GRPO steps; the evaluate as shipped
    "stages.sft.config.max_steps": 20,
    "stages.grpo.config.max_steps": 20,
    "stages.grpo.config.eval_every": 20,
    "stages.grpo.config.save_steps": 20,
}


@pytest.mark.parametrize("engine", ["local", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_gemma3_sft_grpo_evaluate_on_one_gpu(tmp_path: Path, engine: str):
    if not GGUF.is_file():
        pytest.skip(f"no {GGUF.relative_to(ROOT)}: make gemma3 fetches it")
    sets = dict(SHRUNK)
    if engine == "vllm":
        from stages.lib.backends.vllm import server as vllm_server

        try:
            vllm_server.find_vllm_python(gpus=1)
        except RuntimeError as err:
            pytest.skip(str(err))
        sets["stages.grpo.config.backend"] = "{kind: vllm}"
    args = [sys.executable, "-m", "engine.cli", "run", "pipelines/gemma3_grpo.yaml"]
    args += ["--run-dir", str(tmp_path / "run")]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "grpo/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(r["probe_diff"] <= 1e-3 for r in rows if r["updates"])
    assert rows[-1]["eval_accuracy"] is not None  # scored on the held-out prompts at step 20
    settings = json.loads((run / "grpo/settings.json").read_text())
    assert settings["lora"]["status"] == "applied"
    report = json.loads((run / "evaluate/report.json").read_text())
    assert [r["n"] for r in report["results"]] == [200, 200, 200]  # base, SFT, GRPO
    base, sft = (r["accuracy"] for r in report["results"][:2])
    assert sft > base  # the SFT learnt the answer format at least

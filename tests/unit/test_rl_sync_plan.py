"""The weight-sync backend that runs, from where actor rank 0 and the engines are: one rule
for `pipe plan` and the run (`stages.rl.sync.choice`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from engine.stage import Slot
from stages.rl.sync.choice import SAME_GPU, SyncChoice, choose_sync, shared_gpu
from tests.conftest import run_cli

W0, W1 = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


def test_colocated_engine_and_actor_same_gpu_sync_not_nccl():
    """NCCL refuses actor rank 0 and the engine on one GPU ('Duplicate GPU detected' on the
    first H100 run): colocated, the choice is gloo, with the reason."""
    colocated = [Slot("n0", W0, (0,), "vllm"), Slot("n0", W0, (0,), "actor")]
    assert shared_gpu((W0, 0), colocated)
    choice = choose_sync("nccl", actor_gpu=True, engine_gpu=True, shared_gpu=True)
    assert choice == SyncChoice("gloo", SAME_GPU)
    # apart (devices of their own, or the same device number on another worker): nccl
    apart = [Slot("n0", W0, (1,), "vllm"), Slot("n0", W0, (0,), "actor")]
    assert not shared_gpu((W0, 0), apart)
    assert not shared_gpu((W0, 0), [Slot("n1", W1, (0,), "vllm"), Slot("n0", W0, (0,), "actor")])
    assert choose_sync("nccl", actor_gpu=True, engine_gpu=True, shared_gpu=False) == SyncChoice(
        "nccl"
    )
    # an engine on two GPUs of the actor's worker runs on the first of them
    assert shared_gpu((W0, 2), [Slot("n0", W0, (2, 3), "vllm"), Slot("n0", W0, (2, 3), "actor")])
    assert not shared_gpu((W0, 3), [Slot("n0", W0, (2, 3), "vllm")])
    assert not shared_gpu(None, colocated)  # a CPU run: no actor device


def test_sync_choice_off_gpu_and_never_a_silent_fallback_to_disk():
    cpu = choose_sync("nccl", actor_gpu=False, engine_gpu=False, shared_gpu=False)
    assert cpu.backend == "gloo" and "needs GPUs on both ends" in (cpu.reason or "")
    assert choose_sync("gloo", actor_gpu=True, engine_gpu=True, shared_gpu=True) == SyncChoice(
        "gloo"
    )
    # vLLM servers too: the collective as asked (into their workers), disk only when asked
    assert choose_sync("nccl", actor_gpu=True, engine_gpu=True, shared_gpu=False) == SyncChoice(
        "nccl"
    )
    assert choose_sync("disk", actor_gpu=True, engine_gpu=True, shared_gpu=False) == (
        SyncChoice("disk")
    )


PIPELINE = """\
    name: hp
    cluster: {{scheduler: local, workers: 1, gpus: 1, gpus_per_node: 1}}
    profile: high-performance
    resources: {{ratio: {{vllm: 1, actor: 1}}, colocate: {colocate}}}
    stages:
      rl:
        kind: rl
        config:
          input: prompts.jsonl
          model: {{hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 300}}
          verifier: {{kind: regex, pattern: "[0-9]"}}
"""


def test_plan_of_high_performance_colocated_says_gloo_runs_and_why(tmp_path: Path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(textwrap.dedent(PIPELINE.format(colocate="all")))
    result = run_cli("plan", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    assert (
        "high-performance.profile.yaml:23:12: warning: stages.rl.config.vllm_sync_backend: nccl "
        "(profile high-performance: vLLM NCCL backend: faster weight sync) will not run, gloo "
        f"will: {SAME_GPU}"
    ) in result.stderr
    # two GPUs, the engine on its own: nccl runs, nothing to say
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(PIPELINE.format(colocate="none"))
        .replace("gpus: 1,", "gpus: 2,")
        .replace("gpus_per_node: 1", "gpus_per_node: 2")
    )
    result = run_cli("plan", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    assert "vllm_sync_backend" not in result.stderr

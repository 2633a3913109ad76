"""The memory model: parameter counts from config.json, model states against DeepSpeed's own
estimators, activations, colocation with sleep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.plan.memory import (
    MemoryNeed,
    colocated,
    estimate,
    model_states,
    read_shape,
    shape_from_config,
)

LLAMA = {
    "1B": {  # Llama-3.2-1B
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "head_dim": 64,
    },
    "7B": {  # Llama-2-7B
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    "70B": {  # Llama-2-70B
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
}
PUBLISHED = {"1B": 1.24e9, "7B": 6.74e9, "70B": 68.98e9}


@pytest.mark.parametrize("name", list(LLAMA))
def test_parameter_counts_match_the_published_ones(name: str):
    assert shape_from_config(LLAMA[name]).params == pytest.approx(PUBLISHED[name], rel=0.01)


@pytest.mark.parametrize("name", list(LLAMA))
@pytest.mark.parametrize("gpus", [8, 16, 64])
@pytest.mark.parametrize("offload", [False, True])
def test_model_states_agree_with_deepspeeds_estimators(name: str, gpus: int, offload: bool):
    ds2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    shape = shape_from_config(LLAMA[name])
    p, largest, nodes = shape.params, shape.largest_layer_params, gpus // 8
    cpu2, gpu2 = ds2.estimate_zero2_model_states_mem_needs(p, 8, nodes, cpu_offload=offload)
    cpu3, gpu3, _ = estimate_zero3_model_states_mem_needs(
        p, largest, 8, nodes, cpu_offload=offload, cpu_offload_params=False
    )
    for zero, (cpu, gpu) in ((2, (cpu2, gpu2)), (3, (cpu3, gpu3))):
        parts, host = model_states(p, largest, zero, gpus, 8, offload, bf16=True)
        assert sum(parts.values()) == pytest.approx(gpu, rel=0.02), (zero, "gpu")
        assert host * 8 == pytest.approx(cpu, rel=0.02), (zero, "host")  # DeepSpeed: per node


def test_a_checkpoint_needs_only_its_config_json(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA["7B"]))
    assert read_shape(str(tmp_path)) == shape_from_config(LLAMA["7B"])
    assert read_shape(str(tmp_path / "missing")) is None
    tiny = read_shape({"hidden_size": 128, "num_layers": 2, "num_heads": 16, "vocab_size": 512})
    assert (
        tiny is not None
        and tiny.params == 2 * (4 * 128 * 128 + 3 * 128 * 512 + 256) + 512 * 128 + 128
    )


def test_checkpointing_and_smaller_micro_batches_cut_activations():
    base = MemoryNeed("actor", "trainer", LLAMA["7B"], bf16=True, micro_batch=8, seq_len=2048)
    full = estimate(base, 8, 8, 80 * 10**9)
    ckpt = estimate(
        MemoryNeed(**{**base.__dict__, "gradient_checkpointing": True}), 8, 8, 80 * 10**9
    )
    assert full is not None and ckpt is not None
    assert ckpt.parts["activations"] < full.parts["activations"] / 5
    assert ckpt.parts["weights"] == full.parts["weights"]


def test_colocated_roles_sum_and_sleep_frees_the_other_phase():
    device = 80 * 10**9
    actor = MemoryNeed(
        "actor", "trainer", LLAMA["7B"], zero_stage=3, bf16=True, micro_batch=1, seq_len=1024
    )
    engine = MemoryNeed("vllm", "engine", utilization=0.5)
    a, e = estimate(actor, 8, 8, device), estimate(engine, 8, 8, device)
    assert a is not None and e is not None
    awake = colocated([(actor, a), (engine, e)])
    assert awake.gpu_bytes == a.gpu_bytes + e.gpu_bytes
    both = colocated(
        [
            (MemoryNeed(**{**actor.__dict__, "sleep": True}), a),
            (MemoryNeed("vllm", "engine", utilization=0.5, sleep=True), e),
        ]
    )
    # training: the actor alone; generating: the engine and the actor's weights
    assert both.gpu_bytes == max(a.gpu_bytes, e.gpu_bytes + a.parts["weights"])
    assert both.gpu_bytes < awake.gpu_bytes


def test_deepspeed_sleep_holds_the_offloaded_states_on_the_host():
    need = MemoryNeed("actor", "trainer", LLAMA["7B"], zero_stage=3, bf16=True)
    awake = estimate(need, 8, 8, 80 * 10**9)
    asleep = estimate(MemoryNeed(**{**need.__dict__, "sleep": True}), 8, 8, 80 * 10**9)
    assert awake is not None and asleep is not None
    moved = awake.parts["gradients"] + awake.parts["optimizer"]
    assert asleep.host_bytes == awake.host_bytes + moved


def test_a_70b_full_fine_tune_is_refused_with_the_changes_that_fit(tmp_path: Path, monkeypatch):
    from tests.conftest import run_cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama70b").mkdir()
    (tmp_path / "llama70b" / "config.json").write_text(json.dumps(LLAMA["70B"]))
    (tmp_path / "p.yaml").write_text(
        "name: ft70b\n"
        "cluster: {gpus: 16, gpus_per_node: 8}\n"
        "stages:\n"
        "  sft:\n"
        "    kind: train\n"
        "    resources: {role: actor}\n"
        "    config: {input: d.jsonl, model: llama70b, bf16: true, train_batch_size: 64,\n"
        "             micro_train_batch_size: 2, max_length: 2048}\n"
    )
    refused = run_cli("validate", "p.yaml", "--cluster", "2x8x80GB")
    assert refused.exit_code == 2
    assert refused.stderr == (
        "p.yaml:6:16: stages.sft: needs 1389.3 GB per GPU (actor: weights 138.0 GB, gradients "
        "138.0 GB, optimizer 827.7 GB, activations 9.7 GB, buffers 275.9 GB), the GPUs have "
        "80.0 GB; changes that fit, cheapest first: `memory: memory_constrained` -> 24.8 GB\n"
    )
    accepted = run_cli(
        "validate", "p.yaml", "--cluster", "2x8x80GB", "--set", "memory=memory_constrained"
    )
    assert accepted.exit_code == 0, accepted.stderr
    plan = json.loads(
        run_cli(
            "plan",
            "p.yaml",
            "--cluster",
            "2x8x80GB",
            "--format",
            "json",
            "--set",
            "memory=memory_constrained",
        ).stdout
    )
    sft = plan["memory"]["sft"]["actor"]
    assert set(sft) == {"gpu_bytes", "host_bytes", "parts", "nodes"}
    assert sft["nodes"] == {  # the ranks each node holds, and their host bytes together
        node: {"ranks": 8, "host_bytes": 8 * sft["host_bytes"]} for node in ("node0", "node1")
    }
    assert set(sft["parts"]) == {
        "weights",
        "gradients",
        "optimizer",
        "activations",
        "buffers",
        "vllm",
    }
    assert sft["gpu_bytes"] < 80 * 10**9


PROBE = """\
import json, torch
from torch.utils._python_dispatch import TorchDispatchMode
from stages.lib.distributed.rank import init_distributed
init_distributed("deepspeed", "cpu", 1)
import deepspeed
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Embedding(512, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 512, bias=False)
)
ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
      "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False,
                            "reduce_bucket_size": 64 * 64, "offload_optimizer": {"device": "cpu"}},
      "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
made = []
class Record(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            made.append((func.overloadpacket.__name__, str(out.dtype), out.numel()))
        return out
loss = engine(torch.randint(0, 512, (2, 16))).logsumexp(-1).mean()
with Record():
    engine.backward(loss)
staging = engine.optimizer.temp_grad_buffer_for_gpu_offload
print("RESULT " + json.dumps({"staging": [str(staging.dtype), staging.numel()], "made": made}))
"""


def test_zero2_offload_buffers_are_the_ones_deepspeed_allocates():
    """DeepSpeed's ZeRO-2 offload path on the CPU accelerator, one rank: the staging buffer it
    keeps, and the gradient clone and fp64 norm copy it makes during backward, each the size
    `offload_buffers` counts (the largest tensor: the 512 x 64 embedding and output layer,
    larger than the 64^2 reduce bucket)."""
    pytest.importorskip("deepspeed")
    import os
    import socket
    import subprocess
    import sys

    from engine.plan.memory import offload_buffers
    from tests.conftest import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=180
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    seen = json.loads(lines[0][7:])
    made = seen["made"]

    def largest(op: str, dtype: str) -> int:
        return max(n for name, d, n in made if name == op and d == dtype)

    params = 512 * 64 + 64 * 64 + 64 + 64 * 512
    assert seen["staging"] == ["torch.float32", 512 * 64]
    assert offload_buffers(512 * 64, params, 1, bf16=False, bucket=64 * 64) == {
        "staging": 4 * seen["staging"][1],
        "clone": 4 * largest("clone", "torch.float32"),
        "norm": 8 * largest("_to_copy", "torch.float64"),
    }


def test_zero2_offload_on_one_h100_is_within_15_percent_of_what_it_measured():
    """`test_memory_measured.py`'s case (bench/memory.py: a Llama of hidden 512, 8 layers, a
    32000 vocabulary; fp32, micro batch 2 of 128 tokens, one rank) measured 741.5 MB of
    `torch.cuda.max_memory_allocated` on an H100 under ZeRO-2 with `adam_offload`."""
    spec = {**LLAMA["7B"], "hidden_size": 512, "num_hidden_layers": 8}
    spec |= {"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 2048}
    need = MemoryNeed(
        "actor", "trainer", spec, zero_stage=2, adam_offload=True, micro_batch=2, seq_len=128
    )
    est = estimate(need, 1, 1, None)
    largest = 32000 * 512  # the embedding, and the output layer
    # the reduce bucket (512^2 fp32), the staging buffer, the gradient's clone, its fp64 copy
    assert est is not None and est.parts["buffers"] == 4 * 512**2 + (4 + 4 + 8) * largest
    assert est.gpu_bytes == 653_559_808  # was 391_415_808 without the offload buffers
    measured = 741.5e6
    assert measured == pytest.approx(est.gpu_bytes, rel=0.15)

"""LoRA's plan side and its vLLM sync without vLLM: the block's defaults, located refusals,
the memory model's adapter-only states, the servers' LoRA flags, and the adapter folders a
sync writes and the servers are told to load."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from engine.plan.adapters import lora_params
from engine.plan.memory import MemoryNeed, estimate, shape_from_config
from stages.lib.model.lora import PROJECTIONS, LoraBlock
from tests.conftest import run_cli

GEMMA3_270M = {  # google/gemma-3-270m's config.json (the fields the memory model reads)
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 640,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "intermediate_size": 2048,
    "vocab_size": 262144,
    "tie_word_embeddings": True,
}


def test_the_block_defaults_follow_peft_and_alpha_is_twice_the_rank():
    lora = LoraBlock()
    assert (lora.rank, lora.scale_alpha, lora.dropout, lora.save) == (16, 32.0, 0.0, "merged")
    assert lora.targets() == PROJECTIONS
    assert LoraBlock(rank=8, alpha=4).scale_alpha == 4.0
    assert LoraBlock(target_modules=["q_proj", "v_proj"]).targets() == ("q_proj", "v_proj")


def test_adapters_are_rank_times_in_plus_out_per_projection():
    shape = shape_from_config(GEMMA3_270M)
    # q 640->1024, k and v 640->256, o 1024->640, gate and up 640->2048, down 2048->640
    per_layer = 16 * ((640 + 1024) * 2 + (640 + 256) * 2 + (640 + 2048) * 3)
    assert lora_params(shape, 16, PROJECTIONS) == (18 * per_layer, 16 * 2048)
    assert lora_params(shape, 16, ("q_proj", "nonesuch")) == (18 * 16 * 1664, 16 * 1024)


def test_the_memory_model_counts_gradients_and_optimizer_states_for_the_adapters_only():
    shape = shape_from_config(GEMMA3_270M)
    common: dict[str, Any] = {"model": GEMMA3_270M, "bf16": True, "micro_batch": 4}
    full = estimate(MemoryNeed(**common), 1, 1, None)
    lora = estimate(MemoryNeed(**common, lora_rank=16, lora_targets=PROJECTIONS), 1, 1, None)
    assert full is not None and lora is not None
    adapters, _ = lora_params(shape, 16, PROJECTIONS)
    assert full.parts["optimizer"] == 12 * shape.params  # fp32 master + m + v, every weight
    assert lora.parts["optimizer"] == 12 * adapters  # 45.6 MB instead of 3.2 GB
    assert lora.parts["gradients"] == 2 * adapters  # ZeRO-0: the adapters' bf16 gradients
    assert lora.parts["weights"] == 2 * (shape.params + adapters)  # the frozen base, whole
    assert lora.parts["activations"] == full.parts["activations"]
    assert lora.gpu_bytes < full.gpu_bytes / 2  # activations (3.3 GB at 4 x 512) remain


def plan_json(tmp_path: Path, config: str, *sets: str) -> dict[str, Any]:
    (tmp_path / "gemma").mkdir(exist_ok=True)
    (tmp_path / "gemma" / "config.json").write_text(json.dumps(GEMMA3_270M))
    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        "name: p\n"
        "cluster: {gpus: 1}\n"
        "stages:\n"
        "  sft:\n"
        "    kind: train\n"
        "    resources: {role: actor}\n"
        f"    config: {{input: d.jsonl, model: gemma, bf16: true{config}}}\n"
    )
    args = ["plan", "p.yaml", "--cluster", "1x1x80GB", "--format", "json"]
    for s in sets:
        args += ["--set", s]
    result = run_cli(*args, cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_pipe_plan_shows_the_smaller_optimizer_with_lora(tmp_path: Path):
    full = plan_json(tmp_path, "")["memory"]["sft"]["actor"]["parts"]
    plan = plan_json(tmp_path, ", lora: {rank: 16}")
    parts = plan["memory"]["sft"]["actor"]["parts"]
    assert plan["stages"]["sft"]["config"]["lora"] == {
        "rank": 16,
        "alpha": None,
        "dropout": 0.0,
        "target_modules": "all-linear",
        "save": "merged",
        "load_in_4bit": False,
    }
    assert parts["optimizer"] * 50 < full["optimizer"]
    assert parts["gradients"] * 50 < full["gradients"]
    explained = run_cli("plan", "p.yaml", "--cluster", "1x1x80GB", "--explain", cwd=tmp_path)
    lines = [line.strip() for line in explained.stdout.splitlines()]
    assert any(re.fullmatch(r"lora\.rank +16  <- p\.yaml:7:69", line) for line in lines)
    memory = next(line for line in lines if line.startswith("sft (actor):"))
    assert "gradients 0.0 GB, optimizer 0.0 GB" in memory  # 7.6 MB and 45.6 MB


REFUSED = """\
name: p
cluster: {gpus: 0}
stages:
  t: {kind: train, config: {input: x.jsonl, zero_stage: 3, lora: {load_in_4bit: true}}}
  r: {kind: rl, config: {input: x.jsonl, algorithm: ppo, lora: {rank: 8}}}
"""
WARNED = """\
name: p
stages:
  u: {kind: train, config: {input: x.jsonl, lora: {target_modules: [q_proj, wq]}}}
"""


def test_what_cannot_act_is_refused_at_validate_located(tmp_path: Path):
    (tmp_path / "x.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(REFUSED)
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "p.yaml:4:81: stages.t.config.lora.load_in_4bit: LoRA under ZeRO-3 (p.yaml:4:57) is not "
        "supported: adapters are made after the partitioned model and would train "
        "unpartitioned, and the frozen base needs no optimizer states to shard; use zero_stage "
        "0, 1 or 2",
        "p.yaml:4:81: stages.t.config.lora.load_in_4bit: 4-bit loading (QLoRA) is bitsandbytes' "
        "CUDA kernels: it has no 4-bit training path on the CPU here; this stage has no GPU",
        "p.yaml:5:71: stages.r.config.lora.rank: LoRA trains the actor's adapters only, and "
        "algorithm ppo (p.yaml:5:53) trains a critic whose weights would all train beside it; "
        "use algorithm grpo, or leave lora out",
    ]
    (tmp_path / "p.yaml").write_text(WARNED)
    warned = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert warned.exit_code == 0
    assert warned.stderr.splitlines() == [
        "p.yaml:3:68: warning: stages.u.config.lora.target_modules: 'wq': not a decoder "
        "projection the memory estimate knows (q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj); counted as none, and the run fails if the model has no module of "
        "that name",
    ]


def test_the_servers_start_with_vllms_lora_support():
    from stages.rl.rollout.vllm_servers import lora_rank_arg, server_args

    args = server_args(False, False, None, lora_rank=4)
    at = args.index("--enable-lora")
    flags = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--max-cpu-loras"]
    assert args[at:] == [*flags, "2"]
    assert "--enable-lora" not in server_args(False, False, None)
    assert [lora_rank_arg(r) for r in (1, 8, 9, 64, 300)] == [1, 8, 16, 64, 320]


class Servers:
    """Two servers' HTTP routes as the receiver calls them (the edge: vLLM's API)."""

    name, names, urls = "vllm-0,vllm-1", ["vllm-0", "vllm-1"], ["http://a", "http://b"]

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.served = "base"

    def post(self, url: str, body: Any = None, timeout: float = 600) -> Any:
        self.calls.append((url, body))
        return {}

    def serve(self, name: str) -> None:
        self.served = name


def test_each_sync_writes_a_new_adapter_folder_every_server_loads_by_a_new_name(tmp_path: Path):
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.lib.model.lora.sync_writer import write_sync_adapter
    from stages.lib.model.lora.wrap import with_lora
    from stages.rl.sync.vllm import VLLMLoraReceiver

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=50,
    )  # fmt: skip
    torch.manual_seed(0)
    model = with_lora(LlamaForCausalLM(config), LoraBlock(rank=4))
    servers = Servers()
    receiver = VLLMLoraReceiver(servers, str(tmp_path / "sync"))  # type: ignore[arg-type]
    for version in (1, 2):
        folder = receiver.group["adapter_dir"]
        assert folder == str(tmp_path / "sync" / f"lora-{version:06d}")
        stats = write_sync_adapter(model, folder)  # what actor rank 0 does
        receiver.apply(None)
        assert servers.served == f"pipe-lora-{version}"
    written = tmp_path / "sync" / "lora-000002"
    assert sorted(p.name for p in written.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    weights = load_file(str(written / "adapter_model.safetensors"))
    assert len(weights) == 14 and all(".lora_" in k for k in weights)  # no base weight travels
    assert stats["bytes"] == (written / "adapter_model.safetensors").stat().st_size
    assert json.loads((written / "adapter_config.json").read_text())["r"] == 4
    assert not (tmp_path / "sync" / "lora-000001").exists()  # unloaded, then removed
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    assert sorted(servers.calls, key=str) == sorted(
        [(f"{u}{load}", {"lora_name": "pipe-lora-1", "lora_path": str(tmp_path / "sync/lora-000001")}) for u in servers.urls]
        + [(f"{u}{load}", {"lora_name": "pipe-lora-2", "lora_path": str(written)}) for u in servers.urls]
        + [(f"{u}{unload}", {"lora_name": "pipe-lora-1"}) for u in servers.urls],
        key=str,
    )  # fmt: skip


@pytest.mark.parametrize("save", ["merged", "adapter"])
def test_a_merged_output_equals_the_adapted_model(tmp_path: Path, save: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from stages.lib.model.lora.output import write_output
    from stages.lib.model.lora.wrap import with_lora

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=50, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    lora = LoraBlock(rank=4, save=save)  # type: ignore[arg-type]
    model = with_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # as if trained
    ids = torch.tensor([[1, 5, 7, 9]])
    want = model(ids).logits
    write_output(model, None, lora, str(tmp_path / "base"), str(tmp_path / "out"), "float32")
    if save == "merged":
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(ids).logits
    else:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        got = PeftModel.from_pretrained(base, str(tmp_path / "out"))(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_adapters_go_on_without_a_deprecation_warning_from_peft(tmp_path: Path):
    """peft 0.21 reads `is_gradient_checkpointing`, which transformers 5.24 deprecates: every
    LoRA stage printed the FutureWarning once per process."""
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.lib.model.lora.wrap import with_lora

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=50,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = with_lora(LlamaForCausalLM(config), LoraBlock(rank=2))
    assert any("lora_A" in name for name, _ in model.named_parameters())

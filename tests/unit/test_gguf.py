"""A `.gguf` file as a model source (issue 46 point 1): its header read light at validate, the
file converted once per content hash into a checkpoint folder in the run folder, its sha256
in the plan and in the stage's cache key. The file is a tiny Llama written with `gguf`'s own
writer (`tests.gguf_files`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engine.gguf_header import read_header
from stages.lib.model import gguf
from tests.conftest import ROOT, run_cli
from tests.gguf_files import write_tiny_gguf

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The GGUF file (no chat template: a base model) and the model written into it."""
    folder = tmp_path_factory.mktemp("gguf")
    model = write_tiny_gguf(folder / "tiny.gguf")
    return folder / "tiny.gguf", model


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_header_gives_shape_and_template_without_numpy_or_torch(tiny: tuple[Path, Any]):
    path, model = tiny
    code = (
        "import sys; from engine.gguf_header import read_header; "
        "from stages.lib.model.gguf import shape_config; "
        f"h = read_header({str(path)!r}); "
        "print(h.architecture, h.parameters, h.vocab_size, h.tied, h.chat_template); "
        "print(sorted(m for m in ('numpy', 'torch', 'transformers', 'gguf') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    params = sum(p.numel() for p in model.parameters())
    assert out.stdout.splitlines() == [f"llama {params} 261 False None", "[]"]
    assert gguf.shape_config(read_header(str(path))) == {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 261,
        "tie_word_embeddings": False,
        "intermediate_size": 64,
        "num_key_value_heads": 2,
    }


def test_a_gguf_converts_into_a_checkpoint_with_the_same_logits(
    tiny: tuple[Path, Any], tmp_path: Path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, model = tiny
    out = gguf.converted(str(path), "float32", str(tmp_path))
    assert out == f"{tmp_path}/.pipe-models/gguf-{_sha(path)[:16]}-float32"
    assert json.loads(Path(f"{out}.json").read_text()) == {
        "gguf": str(path),
        "sha256": _sha(path),
        "dtype": "float32",
    }
    loaded = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("the cat", return_tensors="pt").input_ids
    assert ids[0, 0].item() == 0  # the file's add_bos_token: <s> first
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert tokenizer.chat_template is None  # a base model's file has none


def test_a_conversion_is_kept_per_content_hash_and_dtype(
    tiny: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    path, _ = tiny
    first = gguf.converted(str(path), "float32", str(tmp_path))
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)

    def no_second_conversion(*args: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf, "convert", no_second_conversion)
    assert gguf.converted(str(copy), "float32", str(tmp_path)) == first  # same bytes, same folder
    monkeypatch.undo()
    half = gguf.converted(str(path), "bfloat16", str(tmp_path))
    assert half.endswith("-bfloat16") and half != first
    assert json.loads(Path(half, "config.json").read_text())["dtype"] == "bfloat16"


PIPELINE = """\
name: p
stages:
  t:
    kind: train
    config: {{input: x.jsonl, model: {model}{extra}}}
"""


def _pipeline(tmp_path: Path, model: str, extra: str = "") -> Path:
    (tmp_path / "x.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(model=model, extra=extra))
    return path


def test_the_plan_shows_the_files_sha256_and_the_cache_key_follows_its_content(
    tiny: tuple[Path, Any], tmp_path: Path
):
    from engine.load.load import load_pipeline
    from engine.plan.checksums import HashCache
    from engine.plan.dag import plan
    from engine.resolve.resolve import resolve
    from engine.run.cache import stage_keys

    shutil.copy(tiny[0], tmp_path / "tiny.gguf")
    _pipeline(tmp_path, "tiny.gguf", ", chat_template: chatml")
    digest = _sha(tmp_path / "tiny.gguf")
    result = run_cli("plan", "p.yaml", "--format", "json", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["stages"]["t"]["sha256"] == {"tiny.gguf": digest}
    explained = run_cli("plan", "p.yaml", "--explain", cwd=tmp_path).stdout.splitlines()
    assert f"  sha256 of tiny.gguf: {digest}" in explained

    def key() -> str:
        old = Path.cwd()
        os.chdir(tmp_path)
        try:
            planned = plan(resolve(load_pipeline(tmp_path / "p.yaml")))
            return stage_keys(planned, HashCache(str(tmp_path / "memo.json")))["t"]
        finally:
            os.chdir(old)

    before = key()
    assert key() == before
    write_tiny_gguf(tmp_path / "tiny.gguf", seed=1)  # other weights, same name
    assert key() != before


def test_replanning_reads_the_file_again_only_when_it_changed(
    tiny: tuple[Path, Any], tmp_path: Path
):
    from engine.plan.checksums import HashCache

    memo = HashCache(str(tmp_path / "memo.json"))
    assert memo.sha256(str(tiny[0])) == _sha(tiny[0])
    memo.save()
    again = HashCache(str(tmp_path / "memo.json"))
    again.entries[str(tiny[0])][2] = "f" * 64  # what the memo says is what it returns
    assert again.sha256(str(tiny[0])) == "f" * 64
    assert again.get(str(tiny[0])) == "f" * 16  # the cache key's part: the same hash


NO_TEMPLATE = (
    "'{path}' has no chat template (a base model): set chat_template to a family (chatml, "
    'gemma, llama3, mistral), plain with a prompt_template such as "Question: {{prompt}}\\n'
    'Answer:", or a Jinja file'
)


def test_a_base_checkpoint_with_no_template_is_refused_at_validate_naming_the_setting(
    tiny: tuple[Path, Any], tmp_path: Path, family_checkpoint: Any
):
    shutil.copy(tiny[0], tmp_path / "tiny.gguf")
    base = tmp_path / "base"
    shutil.copytree(family_checkpoint("chatml"), base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "x.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(
            """\
            name: p
            stages:
              t: {kind: train, config: {input: x.jsonl, model: tiny.gguf}}
              c: {kind: collect, config: {input: x.jsonl, backend: {kind: local, model: base}}}
              e: {kind: evaluate, config: {input: x.jsonl, checkpoints: [base, tiny.gguf]}}
              ok: {kind: train, config: {input: x.jsonl, model: tiny.gguf, chat_template: gemma}}
            """
        )
    )
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "p.yaml:3:52: stages.t.config.model: " + NO_TEMPLATE.format(path="tiny.gguf"),
        "p.yaml:4:77: stages.c.config.backend.model: " + NO_TEMPLATE.format(path="base"),
        "p.yaml:5:61: stages.e.config.checkpoints: " + NO_TEMPLATE.format(path="base"),
        "p.yaml:5:61: stages.e.config.checkpoints: " + NO_TEMPLATE.format(path="tiny.gguf"),
    ]


def test_a_gguf_with_its_own_template_needs_no_setting_and_validate_imports_no_torch(
    tmp_path: Path,
):
    write_tiny_gguf(tmp_path / "chat.gguf", chat_template="{{ messages[0]['content'] }}")
    _pipeline(tmp_path, "chat.gguf")
    code = (
        "import sys; from tests.conftest import run_cli; "
        f"r = run_cli('validate', 'p.yaml', cwd=__import__('pathlib').Path({str(tmp_path)!r})); "
        "print(r.exit_code, r.stderr.strip()); "
        "print(sorted(m for m in ('torch', 'transformers', 'gguf', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.splitlines() == ["0 ", "[]"]


def test_a_missing_gguf_is_a_located_error(tmp_path: Path):
    _pipeline(tmp_path, "models/gemma.gguf")
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "p.yaml:5:37: stages.t.config.model: no GGUF file 'models/gemma.gguf' (relative to the "
        "pipeline's folder)"
    ]


def test_the_memory_model_counts_a_gguf_from_its_header(tiny: tuple[Path, Any]):
    from engine.plan.memory import read_shape
    from stages.train import TrainConfig

    path, model = tiny
    cfg = TrainConfig.model_validate({"input": "x.jsonl", "model": str(path)})
    (need,) = cfg.memory_needs()
    shape = read_shape(need.model)
    assert shape is not None
    assert shape.params == sum(p.numel() for p in model.parameters())


def test_collect_serves_the_converted_gguf_with_the_stages_template(
    tiny: tuple[Path, Any], tmp_path: Path
):
    import logging

    from stages.collect import CollectConfig
    from stages.collect.run import prepared
    from stages.lib.chat.template import template_text

    cfg = CollectConfig.model_validate(
        {
            "input": "x.jsonl",
            "backend": {"kind": "local", "model": str(tiny[0]), "precision": "bfloat16"},
            "chat_template": "plain",
            "prompt_template": "Q: {prompt}\nA:",
        }
    )
    served = prepared(cfg, str(tmp_path), logging.getLogger("test"))
    folder = served.backend.model
    assert folder is not None and folder.startswith(f"{tmp_path}/.pipe-models/template-")
    config = json.loads(Path(folder, "tokenizer_config.json").read_text())
    assert config["chat_template"] == template_text("plain", "Q: {prompt}\nA:")
    weights = Path(folder, "model.safetensors").resolve()
    assert weights.parent.name == f"gguf-{_sha(tiny[0])[:16]}-bfloat16"  # the precision named
    assert served.model_copy(update={"backend": cfg.backend}) == cfg  # nothing else changed


def test_a_missing_fetched_gguf_names_the_command_that_fetches_it(tmp_path: Path):
    """pipelines/gemma3_grpo.yaml names the file `make gemma3` writes, which is not in git."""
    _pipeline(tmp_path, "../models/gemma-3-270m-q4_k_m.gguf")
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "p.yaml:5:37: stages.t.config.model: no GGUF file '../models/gemma-3-270m-q4_k_m.gguf' "
        "(relative to the pipeline's folder): `make gemma3` fetches it (from the repository's "
        "root)"
    ]


def test_one_conversion_per_file_and_dtype_in_a_run_folder_its_bars_in_the_log(
    tiny: tuple[Path, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
):
    """The shipped Gemma 3 pipeline: the SFT converts the GGUF in bf16, the dtype it computes
    in; then evaluate (the local backend, `precision: auto`) loads the baseline from that
    conversion instead of converting in float32 again. A stage that asks for float32 gets
    one float32 conversion, once. transformers' bars go to the stage's log."""
    import logging

    from stages.evaluate import EvaluateConfig
    from stages.evaluate.run import _prepared
    from stages.lib.model.prepared import compute_dtype, prepare_model

    path = str(tiny[0])
    made: list[str] = []
    real = gguf.convert

    def counted(src: str, out: str, dtype: str) -> None:
        made.append(dtype)
        real(src, out, dtype)

    monkeypatch.setattr(gguf, "convert", counted)
    stage = logging.getLogger("pipe.stage.test")
    caplog.set_level(logging.INFO, logger="pipe.stage.test")
    run = str(tmp_path)
    sft = prepare_model(path, run_dir=run, dtype=compute_dtype(True), template=None, log=stage)
    assert made == ["bfloat16"]
    cfg = EvaluateConfig.model_validate({"input": "x.jsonl", "checkpoints": [path]})
    assert cfg.backend.gguf_dtype() == "auto"
    assert _prepared(cfg, [path], run, stage) == [sft]  # the run folder's conversion, not a second
    exact = prepare_model(path, run_dir=run, dtype="float32", template=None, log=stage)
    again = prepare_model(path, run_dir=run, dtype="float32", template=None, log=stage)
    assert exact == again != sft and made == ["bfloat16", "float32"]
    assert _prepared(cfg, [path], run, stage) == [exact]  # auto: the most exact held
    assert gguf.held_dtypes(run, _sha(tiny[0])) == ["float32", "bfloat16"]
    assert made == ["bfloat16", "float32"]
    assert _prepared(cfg, [path], str(tmp_path / "other-run"), stage) != [exact]  # a run of its own
    assert made == ["bfloat16", "float32", "float32"]
    bars = [
        r.getMessage() for r in caplog.records if "Converting and de-quantizing" in r.getMessage()
    ]
    assert len(bars) == 3 and all("100%" in b for b in bars)  # one line per bar, its last frame
    assert "de-quantizing" not in capfd.readouterr().err

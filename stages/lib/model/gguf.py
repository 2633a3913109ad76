"""A `.gguf` file as a model source: its metadata read light, and the file converted once per
content hash into an ordinary checkpoint folder.

Input: the path of a GGUF file (llama.cpp's single-file format: metadata, tokenizer, chat
template and weights, usually quantized), the dtype the stage computes in and the run folder.
Output: the header's figures as a model's shape (`shape_config`, `memory_model`: the header
is read by `engine.gguf_header`, light: `pipe validate` reads it), the plan-time check of a
`.gguf` path, and `converted(path, dtype, run_dir) -> folder`:
`<run-dir>/.pipe-models/gguf-<sha256 prefix>-<dtype>/`, a Hugging Face checkpoint (weights
dequantized into `dtype`, config, the tokenizer and, where the file has one, its chat template;
`<folder>.json` beside it names the file and its sha256), written once (to a temporary sibling,
then renamed) and reused by every later stage and run keyed by the same content: one
conversion per file and dtype in a run folder. A stage with no dtype of its own (`auto`: the
local backend's `precision: auto`, evaluate's and collect's) takes the conversion the run folder
holds already, the one a trainer of the run made in the dtype it computes in, else converts in
float32. transformers' progress bars of the conversion go to the stage's log, not the terminal.

None of the RL frameworks takes a GGUF; transformers (with the `gguf` and `accelerate`
packages: the `gguf` extra) dequantizes it into its architecture's model class and builds a
fast tokenizer from the file's vocabulary. `from_pretrained` keeps the weights in their
quantized blocks unless told otherwise, and such a model refuses `save_pretrained`; asked to
dequantize (`GgufConfig(dequantize=True)`) it is an ordinary model that saves as one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

from engine.checkpoint import shown
from engine.errors import Diagnostic
from engine.gguf_header import GgufHeader, NotGGUF, is_gguf, read_header
from engine.stage import ResolveContext

log = logging.getLogger("pipe.stages.gguf")

MODELS_DIR = ".pipe-models"  # in the run folder: converted checkpoints, shared by its stages
# files a make target fetches (not in git): a refusal of a missing one names the command
FETCHED_BY = {"gemma-3-270m-q4_k_m.gguf": "make gemma3"}


def shape_config(header: GgufHeader) -> dict[str, Any]:
    """The fields of a Hugging Face `config.json` the memory model reads, from the metadata
    (`engine.plan.memory.shape_from_config`); empty where the file does not give them."""
    hidden = header.arch_value("embedding_length")
    layers = header.arch_value("block_count")
    heads = header.arch_value("attention.head_count")
    if not (hidden and layers and heads and header.vocab_size):
        return {}
    out = {
        "hidden_size": int(hidden),
        "num_hidden_layers": int(layers),
        "num_attention_heads": int(heads),
        "vocab_size": header.vocab_size,
        "tie_word_embeddings": header.tied,
    }
    for key, name in (
        ("feed_forward_length", "intermediate_size"),
        ("attention.head_count_kv", "num_key_value_heads"),
        ("attention.key_length", "head_dim"),
    ):
        value = header.arch_value(key)
        if isinstance(value, int):
            out[name] = value
    return out


def sha256_of(path: str) -> str:
    """sha256 of the file's bytes (the hash the plan shows and the cache key holds)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def memory_model(model: Any) -> Any:
    """`model` as the memory model reads it: a GGUF file's shape from its metadata (the
    engine reads a folder's config.json, or a mapping), anything else as it is."""
    if is_gguf(model) and os.path.isfile(model):
        try:
            return shape_config(read_header(model)) or model
        except (NotGGUF, OSError):
            return model
    return model


def check_gguf(ctx: ResolveContext, field: str, value: str) -> list[Diagnostic]:
    """A `.gguf` model path: a file there that reads as GGUF (its header only)."""
    where = "" if value.startswith("/") else " (relative to the pipeline's folder)"
    if not os.path.isfile(value):
        fetch = FETCHED_BY.get(os.path.basename(value))
        hint = f": `{fetch}` fetches it (from the repository's root)" if fetch else ""
        return [ctx.error(field, f"no GGUF file '{value}'{where}{hint}")]
    try:
        header = read_header(value)
    except (NotGGUF, OSError) as e:
        return [ctx.error(field, f"'{shown(value)}' cannot be read as GGUF: {e}")]
    if not header.architecture:
        msg = f"'{shown(value)}' names no architecture (general.architecture)"
        return [ctx.error(field, msg)]
    return []


def converted_path(run_dir: str, digest: str, dtype: str) -> str:
    """Where the checkpoint converted from the GGUF of sha256 `digest` in `dtype` is kept."""
    return f"{run_dir.rstrip('/')}/{MODELS_DIR}/gguf-{digest[:16]}-{dtype}"


AUTO_DTYPE = "float32"  # `auto` with no conversion held: what transformers loads a GGUF in
HELD_FIRST = ("float32", "bfloat16", "float16")  # `auto` with several held: the most exact


def held_dtypes(run_dir: str, digest: str) -> list[str]:
    """The dtypes the run folder holds a finished conversion of the GGUF of sha256 `digest` in,
    the most exact first."""
    prefix = os.path.basename(converted_path(run_dir, digest, "")).rstrip("-") + "-"
    root = f"{run_dir.rstrip('/')}/{MODELS_DIR}"
    names = os.listdir(root) if os.path.isdir(root) else []
    held = [
        n[len(prefix) :]
        for n in names
        if n.startswith(prefix) and ".tmp-" not in n and os.path.isfile(f"{root}/{n}/config.json")
    ]
    rank = {d: i for i, d in enumerate(HELD_FIRST)}
    return sorted(held, key=lambda d: (rank.get(d, len(rank)), d))


def converted(path: str, dtype: str, run_dir: str, logger: logging.Logger | None = None) -> str:
    """The checkpoint folder converted from the GGUF at `path` in `dtype` (`auto`: one the run
    folder holds already, else float32; module docstring), made now unless the run folder
    already keeps it; beside it, `<folder>.json` records the file and its sha256 (outside the
    folder: a checkpoint trained from it copies the folder's files, and is not the GGUF)."""
    logger = logger or log
    digest = sha256_of(path)
    if dtype == "auto":
        held = held_dtypes(run_dir, digest)
        dtype = held[0] if held else AUTO_DTYPE
    out = converted_path(run_dir, digest, dtype)
    if os.path.isfile(os.path.join(out, "config.json")):
        logger.info("%s (sha256 %s): converted already, %s", path, digest, out)
        return out
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converting %s (sha256 %s) into a %s checkpoint: %s", path, digest, dtype, out)
    began = time.perf_counter()
    with bars_to(logger):
        convert(path, tmp, dtype)
    record = {"gguf": os.path.abspath(path), "sha256": digest, "dtype": dtype}
    with open(f"{out}.json", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    try:
        os.replace(tmp, out)
    except OSError:  # another task converted it first: theirs is the same
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise
    logger.info("converted %s in %.1f s", path, time.perf_counter() - began)
    return out


class _BarLines:
    """A stream for progress bars: each bar's last frame before its line ends (tqdm redraws
    with carriage returns, and ends a bar with a newline) as one line of `logger`."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger, self.pending = logger, ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            self._emit(line)
        return len(text)

    def _emit(self, line: str) -> None:
        frame = line.split("\r")[-1].strip() or line.replace("\r", " ").strip()
        if frame:
            self.logger.info("%s", frame)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._emit(self.pending)
        self.pending = ""


@contextlib.contextmanager
def bars_to(logger: logging.Logger) -> Iterator[None]:
    """While open, what is written to stderr (transformers' "Converting and de-quantizing GGUF
    tensors" and "Writing model shards" bars, tqdm's) goes to `logger`, a line per bar. The
    whole process's stderr: in a Dask worker, the stage's own while it converts."""
    stream = _BarLines(logger)
    try:
        with contextlib.redirect_stderr(stream):  # type: ignore[type-var]
            yield
    finally:
        stream.close()


def convert(path: str, out: str, dtype: str) -> None:
    """Dequantize the GGUF at `path` into a checkpoint folder `out` in `dtype`: the model
    (its config without a quantization block), its generation_config, and the tokenizer built
    from the file's vocabulary, with its chat template where the file has one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    options: dict[str, Any] = {}
    try:  # transformers 5 keeps GGUF blocks packed unless asked; 4.x always dequantizes
        from transformers import GgufConfig

        options["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype), **options
    )
    model.config.dtype = getattr(torch, dtype)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out)

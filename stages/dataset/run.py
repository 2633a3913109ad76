"""The dataset stage's body: prompts from a source, split into train and test JSONL.

Input: a resolved `DatasetConfig` (for files, `path` is absolute).
Output: `cfg.output` (training prompts) and `cfg.test_output` (held-out prompts),
one JSON object per line, each with `prompt` (or `messages` when a system
prompt is set) and every other field of the source row; returns row counts. With
`pairs: true` each row is a preference pair as the source has it (`chosen`, `rejected`,
maybe `prompt`: `stages.lib.io.preference`), a row without them an error naming it, and
pairs split by their prompt (an implicit one: what chosen and rejected begin with). With
`nemo_gym_rows: true` each prompt row also carries NeMo Gym's form (`nemo_gym_row`), so one
split feeds both pipe's stages and an environment of kind nemo_gym.

The test split is drawn first and its prompts are unique; training rows whose
prompt text is in the test split are never written, so no evaluation prompt
appears in any training set built from `cfg.output`. For reasoning-gym, test
rows come from a seed far from the training seed (its tasks seed item `i` with
`seed + i`, so nearby seeds would share items).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from stages.lib.io.jsonl import read_jsonl, write_jsonl

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.dataset import DatasetConfig

log = logging.getLogger("pipe.stages.dataset")

TEST_SEED_OFFSET = 1_000_000_007
PROMPT_FIELDS = ("prompt", "question", "problem", "instruction", "input")
ANSWER_FIELDS = ("answer", "solution", "output", "target")


def run_dataset(cfg: DatasetConfig, ctx: StageContext) -> dict[str, Any]:
    """Write the train, test and validation files; return their row counts.

    The validation prompts are the held-out prompts after the test ones (the test split
    stays what it is without them), and no training row shares a prompt with either.
    """
    held = cfg.test_size + cfg.val_size
    if cfg.source == "reasoning_gym":
        train, out = _reasoning_gym_split(cfg, held)
    else:
        train, out = _split_rows(list(_read_source(cfg)), cfg.size, held, cfg.seed)
    test, val = out[: cfg.test_size], out[cfg.test_size :]
    if cfg.system_prompt is not None:
        train, test, val = (
            [with_system_prompt(r, cfg.system_prompt) for r in rows] for rows in (train, test, val)
        )
    if cfg.nemo_gym_rows:
        train, test, val = (
            [nemo_gym_row(r, cfg.source) for r in rows] for rows in (train, test, val)
        )
    write_jsonl(cfg.output, train)
    write_jsonl(cfg.test_output, test)
    write_jsonl(cfg.val_output, val)
    unique = len({prompt_key(r) for r in train})
    log.info(
        "wrote %d training %s (%d unique prompts), %d test rows, %d validation rows",
        len(train),
        "pairs" if cfg.pairs else "rows",
        unique,
        len(test),
        len(val),
    )
    return {
        "train_rows": len(train),
        "test_rows": len(test),
        "val_rows": len(val),
        "unique_train_prompts": unique,
    }


def _reasoning_gym_split(
    cfg: DatasetConfig, held: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if not cfg.task:
        raise ValueError("source 'reasoning_gym' needs a 'task', e.g. chain_sum")
    test = _take_unique(_gym_rows(cfg, cfg.seed + TEST_SEED_OFFSET), held, set())
    banned = {prompt_key(r) for r in test}
    train: list[dict[str, Any]] = []
    for row in _gym_rows(cfg, cfg.seed):
        if len(train) == cfg.size:
            break
        if prompt_key(row) not in banned:
            train.append(row)
    return train, test


def _gym_rows(cfg: DatasetConfig, seed: int, chunk: int = 4096) -> Iterator[dict[str, Any]]:
    """Rows of the task, item after item, without end (the task's items are seeded `seed + i`)."""
    import reasoning_gym

    task = str(cfg.task)
    start = 0
    while True:
        size = max(chunk, cfg.size + cfg.test_size) if start == 0 else chunk
        data = reasoning_gym.create_dataset(task, size=size, seed=seed + start, **cfg.task_config)
        for entry in data:
            yield {
                "prompt": entry["question"],
                "answer": entry["answer"],
                "task": task,
                "metadata": jsonable(entry["metadata"]),
            }
        start += size


def _take_unique(
    rows: Iterable[dict[str, Any]], n: int, seen: set[str], max_draws: int | None = None
) -> list[dict[str, Any]]:
    """The first `n` rows whose prompts are distinct (and not in `seen`)."""
    if n == 0:
        return []
    limit = max_draws if max_draws is not None else 50 * n + 10_000
    out: list[dict[str, Any]] = []
    for drawn, row in enumerate(rows):
        if drawn >= limit:
            raise ValueError(
                f"found only {len(out)} distinct test prompts in {limit} draws; "
                f"the task has too few distinct problems for test_size {n}"
            )
        key = prompt_key(row)
        if key not in seen:
            seen.add(key)
            out.append(row)
            if len(out) == n:
                break
    return out


def _split_rows(
    rows: list[dict[str, Any]], size: int, test_size: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Hold out `test_size` distinct prompts (a seeded shuffle); train on up to `size` others.

    Both splits keep the file's order.
    """
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    test_idx = _take_unique_indices(rows, order, test_size)
    banned = {prompt_key(rows[i]) for i in test_idx}
    held = set(test_idx)
    train = [r for i, r in enumerate(rows) if i not in held and prompt_key(r) not in banned]
    if test_size and len(test_idx) < test_size:
        raise ValueError(
            f"the source has only {len(test_idx)} distinct prompts for test_size {test_size}"
        )
    return train[:size], [rows[i] for i in sorted(test_idx)]


def _take_unique_indices(rows: list[dict[str, Any]], order: list[int], n: int) -> list[int]:
    seen: set[str] = set()
    out: list[int] = []
    for i in order:
        if len(out) == n:
            break
        key = prompt_key(rows[i])
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


def _read_source(cfg: DatasetConfig) -> Iterator[dict[str, Any]]:
    if not cfg.path:
        raise ValueError(f"source '{cfg.source}' needs a 'path'")
    if cfg.source == "jsonl":
        raw: Iterable[dict[str, Any]] = read_jsonl(cfg.path)
    elif cfg.source == "parquet":
        raw = _read_parquet(cfg.path)
    else:
        raw = _read_huggingface(cfg.path, cfg.split)
    for n, row in enumerate(raw, start=1):
        where = f"{cfg.path} row {n}"
        yield normalise_pair(row, where) if cfg.pairs else normalise_row(row, where)


def normalise_pair(row: dict[str, Any], where: str) -> dict[str, Any]:
    """A source row as a preference pair row, every field carried (else a `ValueError`)."""
    from stages.lib.io.preference import pair_problem

    out = {k: jsonable(v) for k, v in row.items()}
    problem = pair_problem(out)
    if problem:
        raise ValueError(f"{where} {problem}")
    return out


def normalise_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    """A source row in prompt-file form: `prompt` or `messages`, `answer`, the rest carried.
    A NeMo Gym row (`responses_create_params`) keeps the fields they are read from: its
    resources server's `/verify` reads them by their own names (reasoning_gym's `question`)."""
    out = {k: jsonable(v) for k, v in row.items()}
    gym = "responses_create_params" in out
    if "messages" not in out and "prompt" not in out:
        key = next((k for k in PROMPT_FIELDS if isinstance(out.get(k), str)), None)
        if key is None:
            raise ValueError(
                f"{where}: no prompt field (one of messages, {', '.join(PROMPT_FIELDS)})"
            )
        out["prompt"] = out[key] if gym else out.pop(key)
    if "answer" not in out:
        key = next((k for k in ANSWER_FIELDS if k in out), None)
        if key is not None:
            out["answer"] = out[key] if gym else out.pop(key)
    return out


def _read_parquet(path: str) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        try:
            import pandas as pd
        except ImportError as e:
            raise RuntimeError("source 'parquet' needs pyarrow (pip install pyarrow)") from e
        yield from pd.read_parquet(path).to_dict(orient="records")
        return
    yield from pq.read_table(path).to_pylist()


def _read_huggingface(path: str, split: str) -> Iterator[dict[str, Any]]:
    """The split's rows of the dataset `path` names: `org/name@<sha>` as the plan pinned it
    (read at that commit), or an id as written."""
    name, _, revision = path.partition("@")
    try:
        import datasets
    except ImportError as e:
        raise RuntimeError(
            "source 'huggingface' needs the 'datasets' package (pip install datasets)"
        ) from e
    try:
        data = datasets.load_dataset(name, split=split, revision=revision or None)
    except Exception as e:  # network errors, unknown ids: all end here, named
        raise RuntimeError(
            f"could not load Hugging Face dataset '{path}' (split '{split}'): {e}"
        ) from e
    yield from data


def prompt_key(row: dict[str, Any]) -> str:
    """The text that decides whether two rows ask the same thing."""
    if "chosen" in row and "rejected" in row:
        from stages.lib.io.preference import pair_prompt_key

        return pair_prompt_key(row)
    if "prompt" in row:
        return str(row["prompt"])
    return json.dumps(row.get("messages"), sort_keys=True)


def with_system_prompt(row: dict[str, Any], system_prompt: str) -> dict[str, Any]:
    """The row in messages form, a system message first."""
    out = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
    messages = (
        list(row["messages"]) if "messages" in row else [{"role": "user", "content": row["prompt"]}]
    )
    messages = [m for m in messages if m.get("role") != "system"]
    out["messages"] = [{"role": "system", "content": system_prompt}, *messages]
    return out


def nemo_gym_row(row: dict[str, Any], source: str) -> dict[str, Any]:
    """The row with NeMo Gym's `responses_create_params` (its prompt, or messages, as the
    `input`), and from reasoning_gym the `question` (the user's text) that NeMo Gym's
    reasoning_gym resources server verifies with, as its `create_dataset.py` writes rows."""
    user = [{"role": "user", "content": row.get("prompt")}]
    messages = row.get("messages", user)
    out = {**row, "responses_create_params": {"input": messages}}
    if source == "reasoning_gym":
        out["question"] = next(m["content"] for m in messages if m["role"] == "user")
    return out


def jsonable(value: Any) -> Any:
    """`value` made JSON-serialisable: containers converted, anything unknown as its string."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [jsonable(v) for v in items]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return jsonable(value.item())
    if hasattr(value, "tolist") and callable(value.tolist):
        return jsonable(value.tolist())
    return str(value)

"""Reward models: the sequence one scores, the head it scores with, and scoring in batches.

Input: a tokenizer, a prompt and a response (`stages.lib.io.preference`'s shapes: text, or
chat messages), and a reward-model checkpoint: a Hugging Face `...ForSequenceClassification`
with one label, as `train` with `algorithm: rm` writes it. Output: the token ids scored
(`score_ids`), the id that pads them (`score_pad_id`), the config fields that make a saved
model load as a reward model (`reward_config`), one score per sequence (`score_batches`,
`RewardScorer`; `score` for token ids already made, as the rl stage's reward role scores
rollouts), the plan-time check that a checkpoint is one (`check_reward_model`, and
`head_problem` for a folder: its `config.json` alone, no torch) and `load_reward_model`
(frozen, in the compute dtype); `closed` (a policy's token ids ended as `score_ids` ends an
answer), the statistics `normalize_reward` divides by (`reward_stats`, `saved_stats`) and the
pad its tokenizer saves (`tokenizer_pad`, `agree_pad`).

One sequence, everywhere: the prompt through the chat template (`format_prompt`), the
response, then the template's closing token(s) of an answer (`answer_end`), as training on
rollouts sees them; a whole conversation rendered up to its last assistant turn the same
way; a text with no prompt (HH's "Human: ... Assistant: ...") tokenized as it is. A
sequence over `max_length` keeps its start and its closing tokens (OpenRLHF's reward
datasets force the EOS at the end the same way), so the score always reads the closing
token. The score is the head's output at the last token that is not padding, as
transformers' `...ForSequenceClassification` pools it: `pad_token_id` is saved in the
config and is never the closing token (a pad equal to it would move the read one token
back), so `AutoModelForSequenceClassification.from_pretrained(dir)` scores exactly what
training computed. The saved tokenizer pads with that id too (`tokenizer_pad`: TRL sets
the config's pad from the tokenizer; here the tokenizer's is set to the config's where the
two would differ, since the config's is never the closing token), and a checkpoint whose two
differ is repaired on load with a warning (`agree_pad`).

An answer cut at `max_output_tokens` ends on a content token. `score_ids` (training,
evaluate) closes every answer with `answer_end`'s ids, so the rl stage closes the policy's
token ids the same way before scoring them (`closed`; OpenRLHF likewise puts the eos token
at the end of every sequence it hands its reward model), and a reward model scores the same
text the same, cut or not, wherever it is read.

`normalize_reward`, as OpenRLHF's flag: the score less a fixed mean, over a fixed standard
deviation, both written into the reward model's `config.json` (`mean`, `std`: OpenRLHF's
keys) at the end of its training (`reward_stats`: over the chosen and rejected scores of the
held-out pairs, as OpenRLHF's last evaluation sets them, else of the training pairs).
Nothing heavy is imported at module level.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.errors import Diagnostic
    from engine.stage import ResolveContext

log = logging.getLogger("pipe.reward_model")
HEAD_SUFFIX = "ForSequenceClassification"
STATS = ("mean", "std")  # config.json: what normalize_reward divides by (OpenRLHF's keys)


def score_ids(
    tokenizer: Any, prompt: Any, response: Any, max_length: int | None = None
) -> list[int]:
    """The token ids a reward model scores for `response` to `prompt` (module docstring)."""
    from stages.lib.chat.prompt import as_messages, prompt_ids
    from stages.lib.chat.tokens import answer_end
    from stages.lib.io.preference import holds_prompt

    end = list(answer_end(tokenizer).ids)
    if not end:
        raise ValueError(
            "the tokenizer has no end-of-sequence token and its chat template ends no answer"
        )

    def text_ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    if isinstance(response, list):
        before = [] if prompt is None or holds_prompt(response) else as_messages(prompt)
        ids = prompt_ids(tokenizer, [*before, *response[:-1]]) + text_ids(response[-1]["content"])
    elif prompt is not None:
        ids = prompt_ids(tokenizer, prompt) + text_ids(response)
    else:
        ids = list(tokenizer(response, add_special_tokens=True)["input_ids"])
        if ids[-len(end) :] == end:  # a tokenizer that appends the end itself
            ids = ids[: -len(end)]
    ids += end
    if max_length is not None and len(ids) > max_length:
        keep = max(max_length - len(end), 0)
        ids = (ids[:keep] + end)[-max_length:]
    return ids


def score_pad_id(tokenizer: Any, config: Any = None) -> int:
    """The pad id of scored batches: the checkpoint's own (`stages.lib.chat.tokens.pad_id`)
    unless it is the closing token the score reads, else the first of unk, bos, the
    end-of-sequence ids and 0 that is not."""
    from stages.lib.chat.tokens import answer_end, eos_ids, pad_id

    stop = answer_end(tokenizer).stop_id
    candidates = [
        pad_id(tokenizer, config),
        getattr(tokenizer, "unk_token_id", None),
        getattr(tokenizer, "bos_token_id", None),
        *eos_ids(tokenizer, config),
        0,
        1,
    ]
    return next(int(c) for c in candidates if c is not None and int(c) != stop)


def reward_config(
    module: Any, pad: int, stats: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """The config.json fields that make a saved checkpoint a reward model: its architecture
    (`...ForSequenceClassification`), one label, the pad id its scores were read with, and
    the statistics `normalize_reward` divides by (`reward_stats`), when given."""
    return {
        "architectures": [type(module).__name__],
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "pad_token_id": pad,
        **(stats or {}),
    }


def closed(ids: Sequence[int], end: Sequence[int], stops: Sequence[int]) -> list[int]:
    """A policy's token ids (prompt and answer) ending as `score_ids` ends an answer: with
    the closing ids `end` (`answer_end(tokenizer).ids`). Kept where they end with them; a last
    id of `stops` (the answer stopped on another end-of-sequence id) replaced by them; else
    (an answer cut at `max_output_tokens`) followed by them (module docstring)."""
    out, end = list(ids), list(end)
    if not end or out[-len(end) :] == end:
        return out
    if out and out[-1] in stops:
        out = out[:-1]
    return out + end


def reward_stats(scores: Sequence[float]) -> dict[str, float]:
    """`{"mean", "std"}` of `scores`, as OpenRLHF's reward-model training sets them: the
    sample standard deviation, at least 1e-8."""
    if len(scores) < 2:
        raise ValueError(f"reward statistics need two scores or more, found {len(scores)}")
    return {"mean": statistics.fmean(scores), "std": max(statistics.stdev(scores), 1e-8)}


def saved_stats(config: Mapping[str, Any]) -> tuple[float, float] | None:
    """(mean, std) a reward model's config.json holds (`reward_stats`), None without them."""
    got = [config.get(k) for k in STATS]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in got):
        return None
    mean, std = float(got[0]), float(got[1])  # type: ignore[arg-type]
    return (mean, std) if math.isfinite(mean) and math.isfinite(std) and std > 0 else None


NO_STATS = (
    "its config.json holds no reward statistics ('mean' and 'std', which train with "
    "algorithm rm writes at the end of training, as OpenRLHF's does), and normalize_reward "
    "divides by them: retrain it with this version of pipe, add them to its config.json, or "
    "leave normalize_reward out"
)


def read_config(model_dir: str) -> dict[str, Any]:
    """A checkpoint folder's config.json as a mapping (empty when it cannot be read)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tokenizer_pad(folder: str, token: str, pad_id: int) -> None:
    """Make the tokenizer files of checkpoint `folder` pad with `token`, id `pad_id` (the
    config's `pad_token_id`): `tokenizer_config.json`'s and `special_tokens_map.json`'s
    `pad_token`, and `tokenizer.json`'s padding where it sets one."""
    for name in ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if name == "tokenizer.json":
            if not isinstance(data.get("padding"), dict):
                continue
            data["padding"].update({"pad_id": pad_id, "pad_token": token})
        elif name == "tokenizer_config.json" or "pad_token" in data:
            data["pad_token"] = token
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, ensure_ascii=False)
            f.write("\n")


def agree_pad(tokenizer: Any, config: Any, where: str, log: logging.Logger) -> None:
    """A loaded reward model's tokenizer made to pad with its config's `pad_token_id` (the
    id transformers pools scores by), with a warning where the saved two differ. Scores here
    are read by each sequence's length, so the repair changes none of them."""
    pad = getattr(config, "pad_token_id", None)
    if pad is None or tokenizer.pad_token_id == pad:
        return
    token = tokenizer.convert_ids_to_tokens(int(pad))
    log.warning(
        "reward model '%s': its tokenizer pads with %r (id %s) and its config.json's "
        "pad_token_id is %s (%r); padding with the config's, which transformers pools the "
        "score by (a checkpoint pipe's train with algorithm rm saves has the two equal)",
        where,
        tokenizer.pad_token,
        tokenizer.pad_token_id,
        pad,
        token,
    )
    tokenizer.pad_token = token


def _config_problem(config: dict[str, Any]) -> str | None:
    """Why a checkpoint's config.json is not a reward model's, or None."""
    archs = config.get("architectures") or []
    if not any(str(a).endswith(HEAD_SUFFIX) for a in archs):
        return (
            f"its config.json names no sequence-classification head (architectures "
            f"{archs or 'missing'}; a reward model's ends with '{HEAD_SUFFIX}', as train with "
            "algorithm rm writes)"
        )
    labels = len(config.get("id2label") or {}) or 2  # transformers' default: 2 labels
    if labels != 1:
        return f"its head has {labels} labels; a reward model scores with one (num_labels 1)"
    return None


def head_problem(model_dir: str) -> str | None:
    """Why the checkpoint folder `model_dir` is not a reward model, read from its config.json
    alone (no torch), or None."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        return f"its config.json cannot be read ({exc})"
    return _config_problem(config)


def load_reward_model(model_dir: str, bf16: bool, device: str) -> Any:
    """The reward model of `model_dir` in the compute dtype (bf16 when `bf16`, else fp32), on
    `device`, in eval mode without gradients."""
    import torch
    from transformers import AutoModelForSequenceClassification

    dtype = torch.bfloat16 if bf16 else torch.float32
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype)
    model.requires_grad_(False)
    return model.to(device).eval()


def check_reward_model(ctx: ResolveContext, field: str, path: str | None) -> list[Diagnostic]:
    """Plan time: `path` is a checkpoint (`check_checkpoint`) and, where it is a folder with a
    config.json, a reward model's (`head_problem`); an earlier stage's output, a hub id or a
    remote URL is checked when it is loaded."""
    from stages.lib.model.path import check_checkpoint

    if path is None:
        return []
    found = check_checkpoint(ctx, field, path)
    if found or not os.path.isfile(os.path.join(path, "config.json")):
        return found
    problem = head_problem(path)
    return [ctx.error(field, f"'{path}' is no reward model: {problem}")] if problem else []


def score(
    model: Any, sequences: Sequence[Sequence[int]], micro_batch: int, pad_id: int = 0
) -> list[float]:
    """Each token id sequence's score under `model` (a scalar-head sequence classifier), in
    micro batches of `micro_batch` right-padded sequences, read at each one's last token (by
    its length: a sequence ending in an id that doubles as the pad id keeps it), from the
    decoder's last hidden state through the `score` head, as transformers pools it."""
    import torch

    device = next(model.parameters()).device
    base = getattr(model, model.base_model_prefix)
    out: list[float] = []
    with torch.no_grad():
        for start in range(0, len(sequences), micro_batch):
            micro = [list(s) for s in sequences[start : start + micro_batch]]
            lengths = torch.tensor([len(s) for s in micro], device=device)
            width = int(lengths.max())
            ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in micro], device=device)
            mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
            hidden = base(input_ids=ids, attention_mask=mask.long()).last_hidden_state
            last = hidden[torch.arange(len(micro), device=device), lengths - 1]
            out += model.score(last)[:, 0].float().tolist()
    return out


def score_batches(
    model: Any, sequences: Sequence[Sequence[int]], pad: int, device: Any, batch_size: int = 64
) -> list[float]:
    """One score per sequence (`score`), in batches of similar lengths; in input order.
    `device` is where `model` is (kept for the callers' symmetry)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    scores = score(model, [sequences[i] for i in order], batch_size, pad)
    out = [0.0] * len(sequences)
    for i, s in zip(order, scores, strict=True):
        out[i] = s
    return out


class RewardScorer:
    """A reward-model checkpoint loaded for scoring (prompt, response) pairs: in `dtype`,
    by default float32 on the CPU and the checkpoint's own dtype on a GPU."""

    def __init__(self, path: str, device: str = "cpu", dtype: Any = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        problem = head_problem(path)
        if problem:
            raise ValueError(f"'{path}' is no reward model: {problem}")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        default = torch.float32 if device == "cpu" else "auto"
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype or default
        )
        self.model.to(device).eval()
        config = self.model.config
        if config.pad_token_id is None:  # transformers needs one to pool a batch
            config.pad_token_id = score_pad_id(self.tokenizer, config)
        agree_pad(self.tokenizer, config, path, log)
        self.pad, self.device = int(config.pad_token_id), device

    def __call__(
        self, items: Sequence[tuple[Any, Any]], max_length: int | None = None
    ) -> list[float]:
        """The score of each (prompt, response)."""
        seqs = [score_ids(self.tokenizer, p, r, max_length) for p, r in items]
        return score_batches(self.model, seqs, self.pad, self.device)

    def close(self) -> None:
        """Release the model (and its GPU memory)."""
        import gc

        import torch

        del self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

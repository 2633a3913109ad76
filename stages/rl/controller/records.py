"""What an rl stage leaves behind besides its checkpoint.

Input: per-step records, held-out scores, and what each setting did at run time.
Output, in the stage's folder: `metrics.jsonl` (one line per step, appended as it
ends; trimmed back to the checkpoint on resume), `samples.jsonl` (the first
`SAMPLES_PER_STEP` samples of step 1 and of every `log_samples_every`-th step, as text and
ids), `rl.png` (reward and held-out accuracy against step; with a reward model, its mean
score beside the verifier's accuracy), and `settings.json`: every field of the resolved
config with its value and whether it was applied (and how) or skipped (and why) in this run
(`max_output_tokens` with the stop ids every answer could end at: `stop_ids`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from typing import Any

from stages.lib.io.audit import SAMPLES, token_record
from stages.lib.io.jsonl import atomic_path, atomic_write, write_json
from stages.lib.io.metrics import Metrics

SAMPLES_PER_STEP = 4


def read_metrics(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def trim_metrics(path: str, step: int) -> None:
    """Keep the records of steps up to `step` (what the checkpoint holds)."""
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept))


def append_metrics(path: str, record: dict[str, Any]) -> None:
    """One step's line in `metrics.jsonl`, and the same numbers to the run's trackers."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    Metrics(os.path.dirname(path)).log(int(record.get("step", 0)), {**record, "step": None})


def logs_samples(step: int, every: int) -> bool:
    """Whether step `step` writes its first samples to `samples.jsonl`: step 1 (so a 3-step run
    shows its first batch) and every `every`-th step; none with `every` 0."""
    return every > 0 and (step == 1 or step % every == 0)


def sample_records(step: int, samples: Sequence[Any], tokenizer: Any) -> list[dict[str, Any]]:
    """The first `SAMPLES_PER_STEP` of a step's batch as it goes to the actor: text and ids,
    loss mask, the engine's (behaviour) log-probabilities, the reference's and the teacher's
    where the step has them (one per completion id, else empty), reward and advantage (PPO,
    REINFORCE++ and with a teacher: per token)."""
    out = []
    for index, s in enumerate(samples[:SAMPLES_PER_STEP]):
        out.append(
            {
                "step": step,
                "index": index,
                "version": s.version,
                **token_record(tokenizer, s.ids, s.prompt_len, s.mask),
                "behaviour_logprobs": [round(x, 6) for x in s.old_logprobs],
                "ref_logprobs": [round(x, 6) for x in s.ref_logprobs],
                "teacher_logprobs": [round(x, 6) for x in s.teacher_logprobs],
                "reward": s.reward,
                "advantage": s.advantage,
                "advantages": [round(x, 6) for x in s.advantages],
            }
        )
    return out


def plot(
    records: list[dict[str, Any]], path: str, title: str, start: float | None = None
) -> str | None:
    """Reward mean (and held-out accuracy where scored, `start` at step 0: before training)
    against step; with a reward model (`rm_score_mean` in the records) its mean score on a
    second axis instead, beside the verifier's held-out and per-step accuracy: where the score
    climbs and accuracy does not, the policy over-optimises the model. None without
    matplotlib or records."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not records:
        return None
    fig = figure(records, title, start)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path


def figure(records: list[dict[str, Any]], title: str, start: float | None = None) -> Any:
    """`plot`'s figure (a matplotlib Figure; its axes' lines carry their labels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    scored = [r for r in records if r.get("rm_score_mean") is not None]
    lines = []
    if not scored:
        lines += ax.plot(steps, [r["reward_mean"] for r in records], label="reward mean")
    else:
        accurate = [r for r in records if r.get("accuracy") is not None]
        if accurate:
            lines += ax.plot(
                [r["step"] for r in accurate],
                [r["accuracy"] for r in accurate],
                alpha=0.5,
                label="accuracy (the step's samples)",
            )
    evals = [(r["step"], r["eval_accuracy"]) for r in records if r.get("eval_accuracy") is not None]
    if start is not None:
        evals.insert(0, (0, start))
    if evals:
        lines += ax.plot(
            [step for step, _ in evals], [acc for _, acc in evals], "o-", label="held-out accuracy"
        )
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    if scored:
        ax.set_ylabel("verifier accuracy")
        right = ax.twinx()
        lines += right.plot(
            [r["step"] for r in scored],
            [r["rm_score_mean"] for r in scored],
            color="tab:red",
            label="reward model score (mean)",
        )
        right.set_ylabel("reward model score")
    ax.set_title(title)
    ax.legend(lines, [str(line.get_label()) for line in lines], loc="best")
    fig.tight_layout()
    return fig


DATE_HOW = "the run's date: chat templates that read the date render this day"


def settings_record(config: Any, how: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Every field: `{"value", "status": applied|skipped, "how"}`; a field nobody accounted
    for is an error (a setting must act, or say why it did not)."""
    data = config.model_dump(mode="json")
    missing = sorted(set(data) - set(how))
    if missing:
        raise RuntimeError(f"settings not accounted for at run time: {', '.join(missing)}")
    return {key: {"value": data[key], "status": how[key][0], "how": how[key][1]} for key in data}


def write_settings(
    path: str,
    config: Any,
    how: dict[str, tuple[str, str]],
    stop_ids: Sequence[int] = (),
    date: str = "",
) -> None:
    """`settings_record`; `max_output_tokens` also names the stop ids that end an answer
    earlier (`stop_ids`: what the engine sent or stopped at, from the checkpoint), and the
    run's date (`date`, what chat templates that read the date rendered:
    `stages.lib.chat.clock`) where there is one."""
    record: dict[str, Any] = settings_record(config, how)
    if "max_output_tokens" in record:
        entry = record["max_output_tokens"]
        entry["how"] += f"; an answer ends earlier at any of the stop ids {list(stop_ids)}"
        entry["stop_ids"] = [int(i) for i in stop_ids]
    if date:
        record["date"] = {"value": date, "status": "applied", "how": DATE_HOW}
    write_json(path, record)


def resume_point(
    stage_dir: str, resume_key: str, log: logging.Logger
) -> tuple[str | None, int, int]:
    """The checkpoint tag to resume from, its step and weight version (None, 0, 0: a fresh
    start, whatever an earlier run left cleared)."""
    root = f"{stage_dir}/checkpoints"
    latest = f"{root}/latest"
    if os.path.exists(latest):
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
        state_path = f"{root}/{tag}/rl_state.json"
        if os.path.exists(state_path):
            with open(state_path, encoding="utf-8") as f:
                state = json.load(f)
            if state.get("resume_key") == resume_key:
                for name in ("metrics.jsonl", SAMPLES):
                    trim_metrics(f"{stage_dir}/{name}", int(state["step"]))
                log.info("resuming from %s (step %d)", tag, state["step"])
                return tag, int(state["step"]), int(state.get("version", state["step"]))
        log.warning("checkpoint %s is from another config or input: starting over", tag)
    shutil.rmtree(root, ignore_errors=True)
    for name in ("metrics.jsonl", "settings.json", SAMPLES):
        if os.path.exists(f"{stage_dir}/{name}"):
            os.remove(f"{stage_dir}/{name}")
    return None, 0, 0

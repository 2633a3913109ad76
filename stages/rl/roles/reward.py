"""One rank of the `reward` role, run as its own process: `python -m stages.rl.roles.reward BRIEF`.

Input: the `ActorBrief` the actor reads, its `model_dir` the reward model's (a scalar-head
checkpoint, `stages.lib.model.reward_model`), and the rank in the environment; the role's
ranks form their own torch.distributed job on the reward role's devices (its own GPUs in the
ratio, or shared with the critic's under `colocate: [[critic, reward]]`, or on the CPU).
Output: answers to the stage's requests: `reward_scores` (each sequence's score, in the
compute dtype, in micro batches of `micro_train_batch_size`; every rank scores every
world-th sequence and rank 0 returns them in order), `stop`. And `RewardRanks`, the
controller's side: started with the other roles, asked for each rollout batch's scores
before its rewards and advantages are made.

What a rank scores of an episode (`RewardRanks.score`), by `reward_sequences`
(`stages.lib.model.reward_tokens`; `auto` is decided here when the plan could not): `ids`,
the policy's token ids closed as every answer a reward model reads is closed
(`stages.lib.model.reward_model.closed`: an answer cut at `max_output_tokens` gets the
template's closing ids, as training and evaluate put them); `text`, the conversation with the
answer decoded from the policy's ids (special tokens skipped), which the rank renders with
the reward model's chat template and tokenizes with its tokenizer (`score_ids`, as training
and evaluate do). Either way the same answer gets the score evaluate gives it. The reward
model's statistics (`saved_stats`) are read here for `normalize_reward`, which refuses a
model without them.

The reward model is whole on every rank (not split by ZeRO-3): the memory model counts it so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from stages.lib.distributed.rank import exit_now

log = logging.getLogger("pipe.rl.reward")


class RewardRank:
    """One rank of the `reward` role: the frozen reward model, scoring its share of a batch."""

    def __init__(self, brief: Any, rank: int, world: int, device: str) -> None:
        from stages.lib.chat.tokens import pad_id
        from stages.lib.model.reward_model import load_reward_model
        from stages.rl.roles.rank_process import log_placed

        self.cfg, self.rank, self.world = brief.config, rank, world
        self.model_dir = brief.model_dir
        self.model = load_reward_model(brief.model_dir, self.cfg.bf16, device)
        self.pad_id = pad_id(None, self.model.config)
        self.tokenizer: Any = None  # the reward model's: loaded for the first texts
        self.kind = f"reward model, {next(self.model.parameters()).dtype}"
        log_placed(log, "reward model", rank, world, self.kind)

    def _ids(self, payload: dict[str, Any]) -> list[list[int]]:
        """The payload's token id sequences, or its texts (`(prompt, response)`) as the reward
        model's tokenizer and chat template make them (`score_ids`)."""
        if "sequences" in payload:
            return [list(s) for s in payload["sequences"]]
        from transformers import AutoTokenizer

        from stages.lib.model.reward_model import agree_pad, score_ids

        if self.tokenizer is None:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            agree_pad(self.tokenizer, self.model.config, self.model_dir, log)
        return [score_ids(self.tokenizer, p, r) for p, r in payload["texts"]]

    def reward_scores(self, payload: dict[str, Any]) -> list[float] | None:
        """Every world-th sequence from this rank; rank 0 returns them all, in order."""
        from stages.lib.model.reward_model import score
        from stages.rl.roles.rank_process import gather_shares

        sequences = self._ids(payload)
        mine = sequences[self.rank :: self.world]
        scored = score(self.model, mine, self.cfg.micro_train_batch_size, self.pad_id)
        return gather_shares(scored, len(sequences), self.rank, self.world)


class RewardRanks:
    """The controller's side of the reward role's ranks: started where the role's devices
    are (`Roles.start`), asked for each batch's scores, stopped with the stage."""

    def __init__(self, roles: Any, host: str, brief: Any, model_dir: str) -> None:
        """`brief`: the actor's (its `model_dir` the policy's folder); the ranks take their
        own channel and the reward model's folder, and no ds_config (the model is whole on
        every rank)."""
        from stages.lib.model.reward_model import NO_STATS, read_config, saved_stats
        from stages.lib.model.reward_tokens import compare
        from stages.rl.roles.channel import StageEnd

        cfg = brief.config
        self.stats = saved_stats(read_config(model_dir))
        if cfg.normalize_reward and self.stats is None:
            raise ValueError(f"reward_model '{model_dir}': {NO_STATS}")
        self.reading = reading(cfg.reward_sequences, compare(brief.model_dir, None, model_dir))
        self.roles, self.end = roles, StageEnd(host)
        update = {
            "channel": self.end.address,
            "authkey": self.end.authkey.hex(),
            "model_dir": model_dir,
            "ds_config": None,
        }
        self.thread = roles.start("reward", brief.model_copy(update=update), self.end)

    def alive(self) -> bool:
        return bool(
            self.thread.is_alive() if self.thread is not None else self.roles.remote_alive()
        )

    def score(self, traces: Sequence[Any], tokenizer: Any) -> list[float]:
        """Each episode's score from the reward role's ranks (`traces`: the rollout's, with
        their ids and episode; `tokenizer`: the policy's), as the module docstring says."""
        payload = sequences(traces, tokenizer, self.reading.mode)
        scored = self.end.request("reward_scores", payload, timeout_s=3600, alive=self.alive)
        return [float(x) for x in scored]

    def stop(self) -> None:
        self.end.request("stop", timeout_s=600, alive=self.alive)
        if self.thread is not None:
            self.thread.join(timeout=120)


def reading(setting: str, found: Any) -> Any:
    """The `Reading` of `reward_sequences`: the setting where it names one, else `found`."""
    from stages.lib.model.reward_tokens import Reading

    if setting == "auto":
        return found
    return Reading(setting, "as reward_sequences sets it" if setting != found.mode else found.why)


def sequences(traces: Sequence[Any], tokenizer: Any, mode: str) -> dict[str, Any]:
    """The `reward_scores` payload of `traces` (module docstring): `{"sequences": ids}`
    closed with the answer's end, or `{"texts": [(conversation before the answer, answer)]}`
    with each answer decoded from the ids the policy sampled."""
    from stages.lib.chat.tokens import answer_end, eos_ids
    from stages.lib.model.reward_model import closed

    if mode == "ids":
        end, stops = answer_end(tokenizer).ids, eos_ids(tokenizer)
        return {"sequences": [closed(t.ids, end, stops) for t in traces]}
    texts = []
    for t in traces:
        messages = t.episode.messages
        said = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        last = said[-1] if said else len(messages)
        answer = tokenizer.decode(list(t.answers[-1][0]), skip_special_tokens=True) if said else ""
        texts.append((list(messages[:last]), answer))
    return {"texts": texts}


if __name__ == "__main__":
    from stages.rl.roles.rank_process import run_role

    exit_now(run_role(None, log, RewardRank, lambda r: {"reward_scores": r.reward_scores}))

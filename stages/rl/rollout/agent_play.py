"""The rl stage's episodes played by NeMo Gym's agent: its servers, the engine served to them,
and each `/run` read back as the ids the engine saw and wrote.

Input: the rl engine (local, vLLM or the pool of both: `generate(prompts, num_samples, ...)`
with token ids and behaviour log-probs), its tokenizer, the stage's config (kind `nemo_gym`)
and the step's rows (NeMo Gym rows: `responses_create_params` and the fields `/verify` reads).
Output: `AgentPlayer`, a block that serves the engine and starts (or finds) NeMo Gym's
servers for the whole stage; `play_agent(...)`, per row its group of `Trace`s, as
`stages.rl.rollout.token_play.play` gives them for pipe's own environments.

The engine is served by pipe's policy endpoint (`stages.lib.serve.policy`), the same engine
object the stage syncs and probes, so the weights the agent's model server samples with are
the ones `rl` synced last, and the probe checks them as for any environment. NeMo Gym's
`vllm_model_for_training` server asks it for log-probs with token ids, and every assistant
item of a `/run` comes back carrying its turn's `prompt_token_ids`, `generation_token_ids`
and `generation_log_probs`. The endpoint extends a turn's sampled ids with the template's
ids of what follows (token in, token out), so each turn's prompt begins with every id before
it, as NeMo RL checks ("Non-contiguous messages found!").

An episode's sequence is the first turn's prompt, then per turn what its prompt adds to the
ids so far (the observations and the template's ids, outside the loss, log-prob 0.0) and the
turn's generated ids (trained, with their behaviour log-probs). A turn whose prompt does not
begin with the ids so far is not trained on: its episode is masked with that reason, as is
one NeMo Gym masked (`mask_sample`), one without token ids and one whose agent failed; the
step counts them with the episodes an environment broke and fails past
`environment.max_failed_share` (`stages.lib.env.contract.check_failures`). A sequence longer
than `max_length` is cut there, as a one-turn rollout's is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

from stages.lib.env.responses import AgentEpisode, run_all
from stages.rl.rollout.token_play import PlaySettings, Trace

log = logging.getLogger("pipe.stages.rl.agent")


def agent_engine(engine: Any, batch_size: int) -> Any:
    """The rl engine as the policy endpoint's `Engine`: one answer per prompt, with its ids
    and log-probs (a `top_p` other than 1 is refused: the rl engine samples the whole
    distribution, so it would act on nothing)."""

    def run(prompts: list[Any], sampling: Any) -> list[Any]:
        if sampling.top_p != 1.0:
            raise ValueError(f"top_p {sampling.top_p:g}: the rl engine samples with top_p 1")
        gens = engine.generate(
            prompts,
            num_samples=1,
            temperature=sampling.temperature,
            max_new_tokens=sampling.max_tokens,
            seed=sampling.seed or 0,
            batch_size=batch_size,
        )
        return [g[0] for g in gens]

    return run


class AgentPlayer:
    """The engine served and NeMo Gym's servers up, for the stage (module docstring)."""

    def __init__(self, url: str, stack: contextlib.ExitStack) -> None:
        self.url, self._stack = url, stack

    def close(self) -> None:
        self._stack.close()


@contextlib.contextmanager
def _serving(engine: Any, cfg: Any, parser: str | None, batch_size: int) -> Iterator[Any]:
    from stages.lib.backends.endpoint import Endpoint
    from stages.lib.serve.policy import PolicyServer

    key = secrets.token_hex(16)
    server = PolicyServer(
        agent_engine(engine, batch_size),
        engine.tokenizer,
        name="policy",
        parser=parser,
        api_key=key,
        max_tokens=cfg.max_output_tokens,
        max_model_len=cfg.max_length,
        max_batch=batch_size,
        seed=cfg.seed,
    )
    with server:
        yield Endpoint(server.base_url, "policy", "chat", key, tokenizes=True)


def start_agent(engine: Any, cfg: Any, work_dir: str, batch_size: int) -> AgentPlayer:
    """Serve `engine` and start (or find) NeMo Gym's servers against it, for the stage."""
    from stages.lib.env.gym import nemo_gym
    from stages.lib.env.messages import episode_parser

    env = cfg.environment
    parser = episode_parser(env.tool_call_parser, engine.tokenizer)
    stack = contextlib.ExitStack()
    try:
        endpoint = stack.enter_context(_serving(engine, cfg, parser, batch_size))
        url = stack.enter_context(nemo_gym(env, endpoint, work_dir, log))
    except BaseException:
        stack.close()
        raise
    return AgentPlayer(url, stack)


def play_agent(
    player: AgentPlayer, rows: Sequence[dict[str, Any]], s: PlaySettings
) -> list[list[Trace]]:
    """Every row's group of `s.num_samples` episodes, each one `/run` of the agent, as
    token sequences (module docstring)."""
    sampling = {
        "temperature": s.temperature,
        "top_p": 1.0,
        "max_output_tokens": s.max_new_tokens,
    }
    episodes = asyncio.run(
        run_all(
            f"{player.url}/run", list(rows), s.num_samples, sampling, s.concurrency, s.timeout_s
        )
    )
    traces = [agent_trace(e, s.max_length) for e in episodes]
    return [traces[i : i + s.num_samples] for i in range(0, len(traces), s.num_samples)]


def _turns(episode: AgentEpisode) -> list[dict[str, Any]]:
    """The episode's model turns: each distinct bundle of token ids (a turn's message and
    calls may each carry the turn's)."""
    out: list[dict[str, Any]] = []
    for t in episode.token_turns:
        if not out or t != out[-1]:
            out.append(t)
    return out


def agent_trace(episode: AgentEpisode, max_length: int) -> Trace:
    """`episode`'s token sequence, or the episode masked with its reason (module docstring)."""
    t = Trace(episode)  # type: ignore[arg-type]  # an episode as the batch reads one
    if episode.error is not None:
        return t
    if episode.mask_sample:
        episode.error = "masked: NeMo Gym masked the episode (mask_sample)"
        return t
    turns = _turns(episode)
    if not turns or any("generation_token_ids" not in x for x in turns):
        episode.error = (
            "masked: the agent's answer carries no token ids: a turn's prompt past max_length "
            f"({max_length}, the endpoint's context; NeMo Gym's model server answers the "
            "refusal with an empty turn cut for length), or a model server other than "
            "vllm_model_for_training"
        )
        return t
    for k, turn in enumerate(turns, start=1):
        prompt = [int(i) for i in turn.get("prompt_token_ids") or []]
        ids = [int(i) for i in turn["generation_token_ids"]]
        lps = [float(x) for x in turn.get("generation_log_probs") or []]
        if len(lps) != len(ids):
            episode.error = f"masked: turn {k} has {len(ids)} token ids but {len(lps)} log-probs"
            return t
        if k == 1:
            t.ids, t.prompt_len = prompt, len(prompt)
        elif prompt[: len(t.ids)] != t.ids:
            at = next(
                (i for i, (a, b) in enumerate(zip(prompt, t.ids, strict=False)) if a != b),
                min(len(prompt), len(t.ids)),
            )
            episode.error = (
                f"masked: non-contiguous: turn {k}'s prompt does not begin with the ids so far "
                f"(they differ at token {at} of {len(t.ids)})"
            )
            return t
        else:
            t.add(prompt[len(t.ids) :], [], own=False)
        t.add(ids, lps, own=True)
        t.generated += len(ids)
        t.answers.append((tuple(ids), tuple(lps)))
    if len(t.ids) > max_length:  # cut as a one-turn rollout is
        cut = max(max_length, t.prompt_len)
        t.ids, t.cut = t.ids[:cut], True
        t.mask, t.logprobs = t.mask[: cut - t.prompt_len], t.logprobs[: cut - t.prompt_len]
    return t

"""rl's episodes played by NeMo Gym's agent, read back as token sequences
(`stages.rl.rollout.agent_play`): what is trained, what is masked and why. The `/run` results
are NeMo Gym 0.7.0's shape (each assistant item with its turn's token ids, as its
`vllm_model_for_training` server writes them); the servers themselves run in
tests/integration/test_nemo_gym_env.py (marked `gym`)."""

from __future__ import annotations

from typing import Any

from stages.lib.env.responses import agent_episode
from stages.rl.rollout.agent_play import agent_trace

ROW = {"responses_create_params": {"input": [{"role": "user", "content": "weather in sf?"}]}}


def turn_items(prompt: list[int], generated: list[int], call: bool) -> list[dict[str, Any]]:
    ids = {
        "prompt_token_ids": prompt,
        "generation_token_ids": generated,
        "generation_log_probs": [-0.1 * (i + 1) for i in range(len(generated))],
    }
    if call:  # a message and the call it makes: one model turn, each item with its ids
        message = {"type": "message", "role": "assistant", "content": [], **ids}
        function = {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"}
        answer = {"type": "function_call_output", "call_id": "c1", "output": "cold"}
        return [message, {**function, **ids}, answer]
    text = [{"type": "output_text", "text": "cold"}]
    return [{"type": "message", "role": "assistant", "content": text, **ids}]


def run(*turns: list[dict[str, Any]], reward: float = 1.0, **extra: Any) -> Any:
    output = [item for t in turns for item in t]
    return agent_episode(ROW, {"response": {"output": output}, "reward": reward, **extra})


def test_turns_that_extend_the_ids_are_trained_on_their_own_tokens_only():
    first = turn_items([1, 2, 3], [10, 11], call=True)
    second = turn_items([1, 2, 3, 10, 11, 20, 21, 22], [30], call=False)
    t = agent_trace(run(first, second), max_length=64)
    assert t.episode.error is None
    assert (t.ids, t.prompt_len) == ([1, 2, 3, 10, 11, 20, 21, 22, 30], 3)
    assert t.mask == [1, 1, 0, 0, 0, 1]
    assert t.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.1]
    assert (t.generated, t.episode.total, t.episode.turns) == (3, 1.0, 2)


def test_a_turn_whose_prompt_does_not_extend_the_ids_masks_its_episode_with_the_reason():
    first = turn_items([1, 2, 3], [10, 11], call=True)
    rerendered = turn_items([1, 2, 3, 10, 12, 20], [30], call=False)  # the call re-tokenised
    t = agent_trace(run(first, rerendered), max_length=64)
    assert t.episode.error == (
        "masked: non-contiguous: turn 2's prompt does not begin with the ids so far "
        "(they differ at token 4 of 5)"
    )


def test_masked_failed_and_idless_runs_are_not_trained():
    first = turn_items([1, 2, 3], [10], call=False)
    masked = agent_trace(run(first, mask_sample=True), max_length=64)
    assert masked.episode.error == "masked: NeMo Gym masked the episode (mask_sample)"
    failed = agent_trace(run(first, failure_kind="timeout", failure_reason="slow"), 64)
    assert failed.episode.error == "timeout: slow" and failed.ids == []
    bare = [{"type": "message", "role": "assistant", "content": []}]
    idless = agent_trace(run(bare), max_length=64)
    assert idless.episode.error is not None and "carries no token ids" in idless.episode.error


def test_a_sequence_past_max_length_is_cut_there():
    first = turn_items([1, 2, 3], [10, 11], call=True)
    second = turn_items([1, 2, 3, 10, 11, 20, 21], [30, 31, 32], call=False)
    t = agent_trace(run(first, second), max_length=6)
    assert (t.ids, t.cut) == ([1, 2, 3, 10, 11, 20], True)
    assert (t.mask, t.logprobs) == ([1, 1, 0], [-0.1, -0.2, 0.0])

"""The rollout engines: what samples the policy, with the behaviour log-probabilities.

Input: the model directory, the step's prompts and the sampling settings. Output: samples
(token ids, behaviour log-probabilities, finish reasons), turn by turn for multi-turn
episodes.

- `generate_args`: what every engine's `generate` is asked for (`Sampling`).
- `local`: the in-process engine (batched local generation on a copy of the policy).
- `vllm`: vLLM servers as the engines; `vllm_servers`: where each server runs and how it
  starts; `vllm_requests`: a step's requests to them.
- `pool`: every engine of the `vllm` role's workers as one.
- `token_play`: episodes at the level of tokens (what the engine saw and wrote, turn by turn).
- `prompts`: the stage's prompt rows, each step's batch, and the sync probe.

Imports the algorithms, the roles' layout and channel, and weight sync's receiving side;
never the controller.
"""

"""The algorithms: what a step computes from samples, free of processes and engines.

Input: samples (token ids, where the completion starts, behaviour log-probabilities,
rewards) and a model's logits. Output: log-probabilities, advantages and losses.

- `options`: the loss and algorithm settings (estimator, loss aggregation, clips, DAPO,
  GSPO, PPO's discount and GAE lambda, the KL, the mismatch corrections); `combinations`:
  the rules `pipe validate` applies to them; `effects`: how each acts in a run.
- `mismatch`: the engine against the actor on the sampled tokens (log-prob difference, k3
  KL, chi-square per token and sequence, perplexity ratio, shares masked); `correction`:
  `tis_mode`'s importance weights, truncated or masked, per token or per sequence.
- `loss`: GRPO's group advantages, the clipped policy loss (per token or per sequence), k3
  KL, how per-token losses add up (`loss_agg`).
- `advantage`: the estimators (grpo, dr_grpo, rloo, reinforce_pp), DAPO's overlong shaping.
- `shaping`: a reward model's scores made rewards (running normalisation, clip, the mix
  with the verifier's).
- `ppo`: per-token rewards with a KL penalty, GAE on the critic's values, the value loss.
- `logprobs`: completion log-probabilities under a model (the actor's and the engine's).
- `packing`: a micro batch laid out as model inputs (padded or packed rows).
- `micro`: each rank's micro batches of one optimizer step, the same count on every rank.

Imports nothing else of the rl stage.
"""

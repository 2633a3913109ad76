"""The rl stage's settings, grouped by concern: one base model per group, flat in the YAML.

Input: a stage's config values (`stages.NAME.config.*`, one flat mapping). Output: the fields
of `stages.rl.RLConfig`, which derives from every group, adds what the stage reads and writes,
and holds the rules that tie the groups together (`check`, `derive`, `memory_needs`).

- `rollout`: the engine, how answers are scored, what a step samples.
- `scoring`: the reward model and how its score becomes the reward.
- `optim`: the actor's optimisation: batch sizes, learning rate and schedule, sequence
  length, the memory savers of its forward and backward, its dtype.
- `distributed`: where and how the trained roles' ranks run (trainer, ranks, threads, ZeRO,
  offload, sleep, async steps) and how their weights reach the engines.
- The loss and algorithm group is `stages.rl.algo.options.AlgorithmOptions`, beside the
  algorithms it selects.

Imports nothing else of the rl stage.
"""

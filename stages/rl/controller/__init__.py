"""The controller: the rl stage's loop over steps, on top of the roles, engines and sync.

Input: a resolved `RLConfig` and the `StageContext`. Output: the stage's records and
checkpoint (`core.Controller.run`).

- `core`: the `Controller` (engines, the roles' channels, one step's parts).
- `start`: the model, the ranks, the engines and the first sync.
- `loop`: the steps, synchronous or asynchronous; `batch`: one rollout batch, scored,
  with advantages; `records`: metrics, plot, settings, resume points; `settings`: what
  each setting did in this run; `remote`: the stage's task on another worker.
"""

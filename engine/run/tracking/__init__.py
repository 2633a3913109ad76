"""Tracking: a run's plan, stage statuses and metric events -> experiment trackers.

Input: the `Plan`, the live `RunReport` and each stage's `track.jsonl`. Output: one
tracker run per `pipe run`, one child per stage. `recorder` is the driver's writer thread;
`base` is the one small interface, one class per transport beside it (`mlflow`,
`tensorboard`, `wandb`), chosen by name in `recorder.make_trackers` only.
"""

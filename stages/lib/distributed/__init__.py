"""Distributed training processes: rank launch and start-up (with the brief every rank reads),
DeepSpeed's config, the optimizer side of a rank, what its checkpoints must match to be
resumed, requests served by a role's ranks, weight groups, sleep (where the optimizer states
go, and moving them to host memory), and the LR schedule.

Input: a rank brief (model, world size, devices, resolved DeepSpeed settings).
Output: rank processes that train or serve (their exit codes and logs followed by the stage),
optimizer steps, and weights sent in buckets over a process group.
"""

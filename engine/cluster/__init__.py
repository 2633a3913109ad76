"""Where stages run: the embedded `LocalCluster`, Slurm batch jobs, or an existing scheduler.

Input: a scheduler address (or `local`, `slurm`) and, for Slurm, the plan's placement.
Output: a connected `Cluster` (`engine.cluster.connect`) whose workers carry their `GPU`
resources, node and device ids.

- `connect`: start or reach the cluster; `slurm`: the batch jobs a plan needs.
- `worker_start`: the embedded cluster's fork server; `worker_setup`: the preload every
  worker `pipe` starts runs (threads, credentials).
"""

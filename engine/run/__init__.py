"""Execute: a `Plan` on a cluster -> a `RunReport`, with the run's records.

Input: a `Plan` (`engine.plan`) and a connected cluster (`engine.cluster`). Output: every
stage run, cached or skipped where its placement says, and the records: `report.json`,
`plan.lock.yaml`, each stage's folder, the trackers.

- `driver`: `pipe run` from file to report (load -> resolve -> plan -> execute).
- `execute`: stages as Dask tasks after their `needs`; `task`: the task on a worker;
  `select`: which stages run (`--only`, `--from`, `--force`, up to date or not).
- `cache`: cache keys and up-to-date checks; `report`: run records; `headline`: what
  the run prints at the end; `tracking/`: the experiment trackers.
"""

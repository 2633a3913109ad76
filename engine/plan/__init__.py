"""Plan: a `ResolvedPipeline` -> a `Plan`, placed and its memory checked.

Input: the resolved pipeline (`engine.resolve`) and, when one is known, a cluster (declared
with `--cluster`, or the live workers). Output: a `Plan` (`engine.plan.dag`): the stages in
execution order, a cache key per stage, the placement map and the memory estimate.

- `dag`: the phase's entry point; `dated`: the run's date; `checksums`: content hashes of
  the files a plan depends on.
- `placement`: slots per stage and role, on a `topology` (the cluster placement works with,
  declared or live; `topology_file`: a declared one, `--cluster C.yaml`).
- `memory`: the memory model (`adapters`: LoRA's parameters); `budget`: refusals of a plan
  that does not fit, with the changes that would.
- `explain`: `pipe plan --explain`.

Imports `engine.resolve`, `engine.load` and the stage API only: no Dask client, no stage
runs here.
"""

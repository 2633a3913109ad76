"""Resolve and plan: a `LoadedPipeline` -> a `ResolvedPipeline` -> a `Plan`.

Input: the validated spec (`engine.spec`), command-line overrides and, when one is known,
a cluster (declared with `--cluster`, or the live workers). Output: a `Plan`
(`engine.plan.dag`): the stages in execution order, every value explicit with its source,
a cache key per stage, the placement map and the memory estimate.

- resolve: `resolve` (the phase's entry point), `resolved` (its output types), `layers` (merge
  order, provenance, conflicts), `roles` (the GPUs of roles and stages), `resources` (the GPU
  split among roles), `paths` (`@stage` references and relative paths), `rules` (validation,
  a kind's derived values and checks).
- plan: `dag` (the phase's entry point), `placement` (slots per stage and role), `memory`
  (the memory model), `budget` (refusals of a plan that does not fit), `cluster` (the
  cluster placement works with) and `cluster_file` (a declared one), `explain`
  (`pipe plan --explain`).

Imports `engine.spec` and the stage API only: no Dask client, no stage runs here.
"""

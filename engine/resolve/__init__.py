"""Resolve: a `LoadedPipeline` -> a `ResolvedPipeline`, every value explicit and its source known.

Input: the loaded pipeline (`engine.load`), the run folder and, when a cluster is known, its
GPU count. Output: a `ResolvedPipeline` (`engine.resolve.types`): each stage's typed, frozen
config with the source of every value, the GPUs of each role and stage, the hub ids pinned.

- `resolve`: the phase's entry point, stage after stage in the order of `needs`.
- `types`: its types (`Draft` under way; `ResolvedPipeline`, `ResolvedStage`, `Source` out).
- `layers`: the merge of kind defaults, presets, `defaults:` and `config:`, with provenance.
- `roles`: the GPUs of roles and stages, over `resources` (the GPU split among roles).
- `paths`: `@stage` references and relative paths; `pins`: hub ids pinned to a commit;
  `checks`: validation, a kind's derived values and checks.

Imports `engine.load` and the stage API only: no placement, no memory model, no Dask.
"""

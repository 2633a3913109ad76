"""Load: the pipeline file -> a validated `PipelineSpec`, every error located.

Input: YAML bytes (a pipeline file, `--set` overrides, preset files). Output: a
`LoadedPipeline` (`engine.load.load`): the frozen, validated `PipelineSpec` and the
`Document` that locates every value at `file:line:col`.

- `source`: YAML -> a plain tree with a location for every node (safe loading only).
- `overrides`: `--set PATH=VALUE` applied to that tree before validation.
- `schema`: the pydantic models of the file; `slurm` and `tracking_block` its two
  blocks (`cluster.slurm:`, `tracking:`);
  `validation`: pydantic's errors located in the file and worded for people.
- `presets`: profiles and memory presets as data.
- `load`: the phase's entry point; `graph` renders the stage graph; `jsonschema` writes
  the JSON Schema editors read.

Imports nothing above it: no resolving, no planning, no Dask.
"""

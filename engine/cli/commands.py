"""The built-in commands of `pipe`: each a thin call into the phase it runs.

Input: each command's arguments and options. Output: what it prints (plans, graphs, lists,
the schema) and the exit code `engine.cli.shell.guard` gives it. `validate` and `plan` go
through `engine.cli.build`, `run` through `engine.run.driver`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from engine.cli.build import build_plan
from engine.cli.shell import EXIT_FAILED, EXIT_OK, guard
from engine.errors import PipeError

F = TypeVar("F", bound=Callable[..., Any])

cluster_option = click.option(
    "--cluster",
    default=None,
    metavar="C.yaml|NxG[xMEMGB]",
    help="Plan against a declared cluster: a file (nodes, gpus_per_node, gpu_memory_gb, "
    "host_memory_gb) or a shorthand such as 6x8x80GB.",
)


set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="PATH=VALUE",
    help="Override a value, dotted from the document root, e.g. stages.collect.config.limit=100.",
)


def format_option(*choices: str) -> Callable[[F], F]:
    """`--format`, one of `choices`, text by default."""
    return click.option(
        "--format", "fmt", type=click.Choice(choices), default="text", show_default=True
    )


@click.command()
@click.argument("pipelines", nargs=-1, required=True, type=click.Path(dir_okay=False))
@set_option
@cluster_option
@guard
def validate(pipelines: tuple[str, ...], overrides: tuple[str, ...], cluster: str | None) -> None:
    """Load, resolve and plan each PIPELINE (placed on a declared --cluster); start nothing and
    ask no model hub (hub ids are pinned by `pipe plan` and `pipe run`)."""
    errors = []
    for path in pipelines:
        try:
            result = build_plan(path, overrides, cluster=cluster, network=False)
        except PipeError as exc:
            errors.extend(exc.diagnostics)
            continue
        click.echo(f"{path}: ok ({len(result.stages)} stages)")
    if errors:
        raise PipeError(errors)


@click.command("plan")
@click.argument("pipeline", type=click.Path(dir_okay=False))
@click.option("--explain", is_flag=True, help="Show every resolved value with where it came from.")
@format_option("text", "yaml", "json")
@click.option("--run-dir", default=None, help="Run directory (default runs/<name>/).")
@set_option
@cluster_option
@guard
def plan_cmd(
    pipeline: str,
    explain: bool,
    fmt: str,
    run_dir: str | None,
    overrides: tuple[str, ...],
    cluster: str | None,
) -> None:
    """Resolve PIPELINE into explicit stage configs: what `pipe run` writes as plan.lock.yaml;
    with --cluster, where every GPU stage sits (a table per node)."""
    quiet = explain and fmt == "text"
    result = build_plan(pipeline, overrides, run_dir, notes=not quiet, cluster=cluster)
    if fmt == "json":
        data = result.as_dict()
        if result.resolved.loaded.spec.cluster.scheduler == "slurm":
            from engine.cluster.slurm import request

            data["slurm"] = request(result).as_dict()  # builds the job script, submits nothing
        click.echo(json.dumps(data, indent=2))
    elif fmt == "yaml" or not explain:
        click.echo(result.to_yaml(), nl=False)
        if fmt == "text" and result.placement is not None and result.cluster is not None:
            click.echo("\n" + result.placement.render_text(result.cluster), nl=False)
    else:
        from engine.plan.explain import explain as explain_text

        click.echo(explain_text(result), nl=False)


@click.command()
@click.argument("pipeline", type=click.Path(dir_okay=False))
@set_option
@click.option(
    "--scheduler",
    default=None,
    help="Dask scheduler address (default: DASK_SCHEDULER_ADDRESS, then cluster.scheduler).",
)
@click.option("--only", multiple=True, metavar="STAGE", help="Run only this stage (repeatable).")
@click.option(
    "--from",
    "from_stage",
    default=None,
    metavar="STAGE",
    help="Re-run this stage and everything after it.",
)
@click.option("--force", is_flag=True, help="Run the selected stages even when up to date.")
@click.option(
    "--keep-going", is_flag=True, help="After a failure, run independent stages to the end."
)
@click.option("--run-dir", default=None, help="Run directory (default runs/<name>/).")
@click.option(
    "--dashboard",
    is_flag=True,
    help="Serve Dask's dashboard from the embedded cluster (needs bokeh); its address is logged.",
)
@guard
def run(
    pipeline: str,
    overrides: tuple[str, ...],
    scheduler: str | None,
    only: tuple[str, ...],
    from_stage: str | None,
    force: bool,
    keep_going: bool,
    run_dir: str | None,
    dashboard: bool,
) -> None:
    """Run PIPELINE on Dask: skip up-to-date stages, retry failures, record everything."""
    from engine.run.driver import RunRequest, run_pipeline
    from engine.run.select import RunOptions

    options = RunOptions(only=only, from_stage=from_stage, force=force, keep_going=keep_going)
    request = RunRequest(pipeline, overrides, scheduler, run_dir, options, dashboard=dashboard)
    report = run_pipeline(request)
    from engine.run.headline import headlines

    for line in headlines(report):  # the result, on stdout: each stage's headline, the trackers
        click.echo(line)
    sys.exit(EXIT_OK if report.status == "succeeded" else EXIT_FAILED)


@click.command()
@click.option(
    "--dir",
    "base",
    type=click.Path(file_okay=False),
    default=None,
    help="Also list presets of this pipeline folder.",
)
@guard
def presets(base: str | None) -> None:
    """List the profiles and memory presets, each setting with its reason."""
    from engine.load.presets import all_presets

    for src in all_presets(Path(base) if base else None):
        p = src.preset
        click.echo(f"{p.kind} {p.name}: {p.description}")
        if p.caution:
            click.echo(f"  caution: {p.caution}")
        if p.resources.colocate is not None:
            click.echo(
                f"  colocate = {p.resources.colocate.value!r}: {p.resources.colocate.reason}"
            )
        for key, setting in p.settings.items():
            click.echo(f"  {key} = {setting.value!r}: {setting.reason}")


@click.command()
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False), default="schemas", show_default=True
)
@click.option(
    "--check", is_flag=True, help="Exit 1 when the committed schema differs from the generated one."
)
@guard
def schema(out_dir: str, check: bool) -> None:
    """Write the pipeline file's JSON Schema to OUT/pipeline.schema.json."""
    from engine.load.jsonschema import SCHEMA_FILE, schema_text

    target = Path(out_dir) / SCHEMA_FILE
    text = schema_text()
    if check:
        current = target.read_text() if target.exists() else ""
        if current != text:
            click.echo(f"{target}: out of date; run `pipe schema --out {out_dir}`", err=True)
            sys.exit(EXIT_FAILED)
        click.echo(f"{target}: up to date")
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    click.echo(f"wrote {target}")


@click.command()
@guard
def stages() -> None:
    """List the stage kinds and where they come from."""
    from engine.stage import kinds

    for name, kind in sorted(kinds().items()):
        doc = (kind.config.__doc__ or "").strip().splitlines()[0]
        click.echo(f"{name:10s} {kind.module:24s} {doc}")


@click.command()
@click.argument("pipeline", type=click.Path(dir_okay=False))
@format_option("mermaid", "dot", "text")
@set_option
@guard
def graph(pipeline: str, fmt: str, overrides: tuple[str, ...]) -> None:
    """Print the stage graph of PIPELINE."""
    from engine.load.graph import render_graph
    from engine.load.load import load_pipeline

    click.echo(render_graph(load_pipeline(pipeline, overrides).spec, fmt), nl=False)

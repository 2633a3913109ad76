"""The `pipe` command: a thin shell over load -> resolve -> plan -> execute.

Exit codes: 0 ok; 1 a stage failed; 2 an invalid pipeline or usage. A user's
mistake prints compiler-style errors and no traceback; `-v` shows one for a bug.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from engine.errors import PipeError, RunFailed

if TYPE_CHECKING:
    from engine.plan.dag import Plan

F = TypeVar("F", bound=Callable[..., Any])
EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def _guard(fn: F) -> F:
    """Turn `PipeError` into its message and exit 2; any other exception is a bug."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        verbose = bool(ctx.find_root().params.get("verbose"))
        try:
            return fn(*args, **kwargs)
        except PipeError as exc:
            click.echo(exc.render(), err=True)
            sys.exit(EXIT_INVALID)
        except RunFailed as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_FAILED)
        except (click.exceptions.Exit, click.ClickException, SystemExit, KeyboardInterrupt):
            raise
        except Exception as exc:
            if verbose:
                raise
            click.echo(
                f"internal error: {type(exc).__name__}: {exc} (run with -v for the traceback)",
                err=True,
            )
            sys.exit(EXIT_FAILED)

    return wrapper  # type: ignore[return-value]


cluster_option = click.option(
    "--cluster",
    default=None,
    metavar="C.yaml|NxG[xMEMGB]",
    help="Plan against a declared cluster: a file (nodes, gpus_per_node, gpu_memory_gb, host_memory_gb) or a shorthand such as 6x8x80GB.",
)


def view_gpus(declared: Any, view: Any) -> int | None:
    """`cluster.gpus: auto` planned against a declared cluster takes the cluster's GPUs."""
    if declared == "auto" and view is not None:
        return len(view.devices())
    return None


def auto_gpus(loaded: Any, view: Any, cluster: str | None) -> tuple[int | None, str, Any]:
    """`cluster.gpus: auto` without a live cluster: a declared `--cluster`'s GPUs, else, for
    the embedded cluster (`scheduler: local`), the GPUs `pipe run` will give its workers
    (visible on this machine, read without torch) and that machine as the cluster placed on;
    a remote scheduler's are known once connected. Returns (gpus, where from, view)."""
    from engine.cluster.connect import local_gpus, scheduler_address

    spec = loaded.spec.cluster
    if spec.gpus != "auto":
        return None, "", view
    if view is not None:
        return view_gpus(spec.gpus, view), f"from --cluster {cluster}", view
    if scheduler_address(None, spec.scheduler) != "local":
        return None, "", None
    return local_gpus(spec.gpus_per_node)


set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="PATH=VALUE",
    help="Override a value, dotted from the document root, e.g. stages.collect.config.limit=100.",
)


COMMANDS_GROUP = "pipe.commands"


class _Commands(click.Group):
    """The built-in commands, plus those stage kinds contribute through the entry-point group
    `pipe.commands` (e.g. collect's `pipe tune`), loaded only when asked for."""

    def _plugins(self) -> dict[str, Any]:
        from importlib import metadata

        return {ep.name: ep for ep in metadata.entry_points(group=COMMANDS_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugins()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None and name in self._plugins():
            loaded = self._plugins()[name].load()
            command = loaded if isinstance(loaded, click.Command) else None
        return command


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-v", "--verbose", is_flag=True, help="Debug logging; tracebacks for internal errors."
)
def main(verbose: bool) -> None:
    """pipe: declarative YAML pipelines for LLM post-training, run on Dask."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if verbose else "%(message)s",
        stream=sys.stderr,
    )
    if not verbose:
        # Dask reads these when distributed is first imported, in the driver and in workers;
        # stage failures are reported by pipe itself, with the stage's log file
        os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "critical")
        for noisy in ("distributed", "tornado", "bokeh", "asyncio"):
            logging.getLogger(noisy).setLevel(logging.CRITICAL)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Load, resolve and plan make some 10^5 small objects with no cycles among them; the
    cyclic collector rescanning them took about half of a 1,000-stage `pipe validate`
    (BENCHMARKS.md). Paused for that bounded work, on again after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def build_plan(
    path: str,
    overrides: tuple[str, ...] = (),
    run_dir: str | None = None,
    notes: bool = True,
    cluster: str | None = None,
) -> Plan:
    """load -> resolve -> plan (placed on a declared `cluster` when given); warnings and notes
    go to stderr (unless `notes` is off)."""
    from engine.plan.dag import plan
    from engine.plan.resolve import resolve
    from engine.spec.load import load_pipeline

    view = None
    if cluster is not None:
        from engine.plan.cluster_file import load_cluster_spec

        view = load_cluster_spec(cluster)
    with _gc_paused():
        loaded = load_pipeline(path, overrides)
        gpus, source, view = auto_gpus(loaded, view, cluster)
        result = plan(resolve(loaded, run_dir=run_dir, gpus=gpus, gpus_from=source), view)
    for note in result.resolved.notes if notes else ():
        click.echo(note.render(), err=True)
    return result


@main.command()
@click.argument("pipelines", nargs=-1, required=True, type=click.Path(dir_okay=False))
@set_option
@cluster_option
@_guard
def validate(pipelines: tuple[str, ...], overrides: tuple[str, ...], cluster: str | None) -> None:
    """Load, resolve and plan each PIPELINE (placed on a declared --cluster); start nothing."""
    errors = []
    for path in pipelines:
        try:
            result = build_plan(path, overrides, cluster=cluster)
        except PipeError as exc:
            errors.extend(exc.diagnostics)
            continue
        click.echo(f"{path}: ok ({len(result.stages)} stages)")
    if errors:
        raise PipeError(errors)


@main.command("plan")
@click.argument("pipeline", type=click.Path(dir_okay=False))
@click.option("--explain", is_flag=True, help="Show every resolved value with where it came from.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "yaml", "json"]),
    default="text",
    show_default=True,
)
@click.option("--run-dir", default=None, help="Run directory (default runs/<name>/).")
@set_option
@cluster_option
@_guard
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


@main.command()
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
@_guard
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


@main.command()
@click.option(
    "--dir",
    "base",
    type=click.Path(file_okay=False),
    default=None,
    help="Also list presets of this pipeline folder.",
)
@_guard
def presets(base: str | None) -> None:
    """List the profiles and memory presets, each setting with its reason."""
    from engine.spec.presets import all_presets

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


@main.command()
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False), default="schemas", show_default=True
)
@click.option(
    "--check", is_flag=True, help="Exit 1 when the committed schema differs from the generated one."
)
@_guard
def schema(out_dir: str, check: bool) -> None:
    """Write the pipeline file's JSON Schema to OUT/pipeline.schema.json."""
    from engine.spec.jsonschema import SCHEMA_FILE, schema_text

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


@main.command()
@_guard
def stages() -> None:
    """List the stage kinds and where they come from."""
    from engine.stage import kinds

    for name, kind in sorted(kinds().items()):
        doc = (kind.config.__doc__ or "").strip().splitlines()[0]
        click.echo(f"{name:10s} {kind.module:24s} {doc}")


@main.command()
@click.argument("pipeline", type=click.Path(dir_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["mermaid", "dot", "text"]),
    default="text",
    show_default=True,
)
@set_option
@_guard
def graph(pipeline: str, fmt: str, overrides: tuple[str, ...]) -> None:
    """Print the stage graph of PIPELINE."""
    from engine.spec.graph import render_graph
    from engine.spec.load import load_pipeline

    click.echo(render_graph(load_pipeline(pipeline, overrides).spec, fmt), nl=False)


if __name__ == "__main__":
    main()

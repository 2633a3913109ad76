"""The `pipe` command: a thin shell over load -> resolve -> plan -> execute.

Exit codes: 0 ok; 1 a stage failed; 2 an invalid pipeline or usage. A user's
mistake prints compiler-style errors and no traceback; `-v` shows one for a bug.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from engine.errors import PipeError

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


set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="PATH=VALUE",
    help="Override a value, dotted from the document root, e.g. stages.collect.config.limit=100.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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


@main.command()
@click.argument("pipelines", nargs=-1, required=True, type=click.Path(dir_okay=False))
@set_option
@_guard
def validate(pipelines: tuple[str, ...], overrides: tuple[str, ...]) -> None:
    """Load, resolve and plan each PIPELINE; start nothing."""
    from engine.load import load_pipeline

    errors = []
    for path in pipelines:
        try:
            loaded = load_pipeline(path, overrides)
        except PipeError as exc:
            errors.extend(exc.diagnostics)
            continue
        click.echo(f"{path}: ok ({len(loaded.spec.stages)} stages)")
    if errors:
        raise PipeError(errors)


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
    from engine.jsonschema import SCHEMA_FILE, schema_text

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
    from engine.graph import render_graph
    from engine.load import load_pipeline

    click.echo(render_graph(load_pipeline(pipeline, overrides).spec, fmt), nl=False)


if __name__ == "__main__":
    main()

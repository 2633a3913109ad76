"""The `pipe` command group: logging, exit codes, and the commands plugins add.

Input: the command line. Output: the exit code: 0 ok; 1 a stage failed; 2 an invalid
pipeline or usage. `guard` turns a user's mistake (`PipeError`) into compiler-style errors
and no traceback; `-v` shows one for a bug. Commands come from `engine.cli.commands` and
from the entry-point group `pipe.commands` (a kind's own, e.g. collect's `pipe tune`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import click

from engine.errors import PipeError, RunFailed

F = TypeVar("F", bound=Callable[..., Any])
EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def guard(fn: F) -> F:
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

"""`pipe tune`: measure a collect stage's throughput against parallelism; find the knee.

Input: a pipeline file and the name of one of its collect stages. Output: a
table (or JSON) of the levels measured, the knee and the recommended
`num_samples_in_parallel` on stdout, a PNG of throughput and latency against
parallelism, and with `--write` the value put into the file
(`stages.collect.tune.write`). `--diagnose` runs the bottleneck test instead
(parallelism 5 against 20) and, when the stage's last `pipe run` held GPUs busy less than
the tuning guide's 80% on average, says so with the guide's fixes. The sweep logic is
`stages.collect.tune.sweep`; the stage and what measures it (the collector's own
`stages.collect.measure.measure_level`, on the first rows of the stage's prompts file) are
`stages.collect.tune.target`'s.

Exit codes: 0 ok; 1 no level ran without errors; 2 an invalid pipeline or usage.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from engine.errors import PipeError
from stages.collect.tune.sweep import (
    DIAGNOSE_LEVELS,
    Diagnosis,
    Level,
    Sweep,
    diagnose,
    gpu_advice,
    sweep,
)
from stages.collect.tune.target import collector_measure, load_target

log = logging.getLogger("pipe.tune")
F = TypeVar("F", bound=Callable[..., Any])
KEY = "num_samples_in_parallel"
LIMITS = {
    "parallelism": "parallelism",
    "backend": "the backend",
    "verification": "verification",
    "client": "the collecting machine",
}


def level_json(level: Level) -> dict[str, Any]:
    return {
        "parallelism": level.parallelism,
        "rollouts_per_s": round(level.rollouts_per_s, 3),
        "p50_s": round(level.p50_s, 4),
        "p95_s": round(level.p95_s, 4),
        "errors": level.errors,
    }


def sweep_json(result: Sweep) -> dict[str, Any]:
    """The `--format json` document: levels, knee, recommended."""
    return {
        "levels": [level_json(lv) for lv in result.levels],
        "knee": result.knee,
        "recommended": result.recommended,
    }


def render_table(levels: tuple[Level, ...] | list[Level]) -> str:
    lines = [f"{'parallelism':>11}  {'rollouts/s':>10}  {'p50 s':>7}  {'p95 s':>7}  {'errors':>6}"]
    for lv in levels:
        lines.append(
            f"{lv.parallelism:>11}  {lv.rollouts_per_s:>10.1f}  "
            f"{lv.p50_s:>7.3f}  {lv.p95_s:>7.3f}  {lv.errors:>6}"
        )
    return "\n".join(lines)


def render_sweep(result: Sweep) -> str:
    out = [render_table(result.levels), f"stopped: {result.stopped}"]
    if result.knee is None:
        out.append("knee: none (every level had errors); check the backend, or lower --start")
        return "\n".join(out)
    peak = max(lv.rollouts_per_s for lv in result.levels if not lv.errors)
    out.append(
        f"knee: {result.knee} (the lowest parallelism within 10% of the best, "
        f"{peak:.1f} rollouts/s)"
    )
    out.append(f"recommended: {KEY}: {result.recommended} (80% of the knee, for headroom)")
    return "\n".join(out)


def plot_levels(
    levels: tuple[Level, ...] | list[Level], path: Path, title: str, knee: int | None = None
) -> Path | None:
    """PNG of throughput and p50/p95 latency against parallelism; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no plot (pip install 'pipe-engine[plot]')")
        return None
    xs = [lv.parallelism for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(xs, [lv.rollouts_per_s for lv in levels], "o-", label="throughput")
    left.set_ylabel("rollouts/s")
    right.plot(xs, [lv.p50_s for lv in levels], "o-", label="p50")
    right.plot(xs, [lv.p95_s for lv in levels], "s--", label="p95")
    right.set_ylabel("latency (s)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("parallelism (requests in flight)")
        if knee is not None:
            ax.axvline(knee, color="grey", linestyle=":", label=f"knee {knee}")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _run(
    pipeline: str,
    stage: str,
    opts: dict[str, Any],
    measure_factory: Any = collector_measure,
) -> int:
    """The command's body; returns the exit code."""
    target = load_target(pipeline, stage, opts["overrides"])
    measure = measure_factory(target, opts["requests"])
    what = "diagnose" if opts["diagnose"] else "tune"
    default_plot = target.loaded.path.with_name(f"{target.loaded.path.stem}.{what}-{stage}.png")
    plot = Path(opts["plot"]) if opts["plot"] else default_plot
    if opts["diagnose"]:
        low, high = (measure(p) for p in DIAGNOSE_LEVELS)
        usage = last_usage(target.stage_dir)
        _report_diagnosis([low, high], diagnose(low, high), opts["fmt"], usage)
        if plot_levels([low, high], plot, f"pipe tune --diagnose: {stage}"):
            click.echo(f"plot: {plot}", err=True)
        return 0
    result = sweep(measure, start=opts["start"], max_levels=opts["max_levels"])
    if opts["fmt"] == "json":
        click.echo(json.dumps(sweep_json(result), indent=2))
    else:
        click.echo(render_sweep(result))
    if plot_levels(result.levels, plot, f"pipe tune: {stage}", result.knee):
        click.echo(f"plot: {plot}", err=True)
    if result.recommended is None:
        return 1
    if opts["write"]:
        from stages.collect.tune.write import write_stage_config_value

        write_stage_config_value(target.loaded.path, stage, KEY, result.recommended)
        click.echo(f"wrote {pipeline}: stages.{stage}.config.{KEY}: {result.recommended}", err=True)
    return 0


def last_usage(stage_dir: str) -> dict[str, Any]:
    """What the stage used in its last `pipe run` (the `"usage"` summary of its
    `metrics.json`); {} when it has not run."""
    try:
        with open(f"{stage_dir}/metrics.json", encoding="utf-8") as f:
            usage = json.load(f).get("usage", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return usage if isinstance(usage, dict) else {}


def _report_diagnosis(
    levels: list[Level], verdict: Diagnosis, fmt: str, usage: dict[str, Any]
) -> None:
    advice = gpu_advice(usage)
    if fmt == "json":
        doc = {
            "levels": [level_json(lv) for lv in levels],
            "verdict": verdict.verdict,
            "reason": verdict.reason,
            "next_step": verdict.next_step,
        }
        if "gpu_util_mean" in usage:  # the stage held GPUs in its last run
            doc.update(gpu_util=usage["gpu_util_mean"], gpu_advice=advice)
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(render_table(levels))
    click.echo(f"verdict: {LIMITS[verdict.verdict]} is the limit")
    click.echo(f"why: {verdict.reason}")
    click.echo(f"next step: {verdict.next_step}")
    for line in advice:  # the GPUs the stage held in its last run, against the guide's 80%
        click.echo(line)


def _count_option(*decls: str, default: int | None, help: str) -> Callable[[F], F]:
    """A whole-number option of at least 1; a default it has is shown in `--help`."""
    return click.option(
        *decls,
        type=click.IntRange(min=1),
        default=default,
        show_default=default is not None,
        help=help,
    )


@click.command("tune")
@click.argument("pipeline", type=click.Path(dir_okay=False))
@click.option("--stage", required=True, help="The collect stage to measure.")
@_count_option("--start", default=8, help="First parallelism level.")
@_count_option("--max-levels", default=8, help="Most levels measured (each doubles the last).")
@_count_option(
    "--requests-per-level",
    "requests",
    default=None,
    help="Requests sent at each level [default: 4 x parallelism, at least 100, "
    "and at least 2 s of the last level's rate].",
)
@click.option(
    "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True
)
@click.option(
    "--write",
    is_flag=True,
    help=f"Put the recommendation into the file's stages.STAGE.config.{KEY}, keeping its layout.",
)
@click.option(
    "--diagnose", is_flag=True, help="Bottleneck test instead of a sweep: parallelism 5 against 20."
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where to write the PNG [default: next to the pipeline file].",
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="PATH=VALUE",
    help="Override a value, dotted from the document root.",
)
def tune_command(pipeline: str, stage: str, **opts: Any) -> None:
    """Find the parallelism knee of a collect STAGE of PIPELINE; recommend 80% of it."""
    if opts["write"] and opts["diagnose"]:
        raise click.UsageError("--write needs a sweep; drop --diagnose")
    try:
        code = _run(pipeline, stage, opts)
    except PipeError as exc:
        click.echo(exc.render(), err=True)
        sys.exit(2)
    except Exception as exc:
        if click.get_current_context().find_root().params.get("verbose"):
            raise
        click.echo(
            f"internal error: {type(exc).__name__}: {exc} (run with -v for the traceback)", err=True
        )
        sys.exit(1)
    sys.exit(code)

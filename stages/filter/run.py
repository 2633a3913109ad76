"""The filter stage's body: a rollout JSONL in; kept rows, a report and a histogram out.

Input: `FilterConfig` with `input` and `output` resolved to absolute paths,
and the `StageContext`. Output: `cfg.output` (the kept lines, byte for byte,
in input order; with `pairs: true` the pairs made from them, `stages.filter.pairs`),
`<stage_dir>/filter_report.json` (rows in, kept, dropped by
reason in rule order, groups, reward summaries, pairs written, how it ran) and
`<stage_dir>/reward_histogram.png`; the report is also the returned metrics. With a
`verifier:` the rows are scored again first (`stages.filter.rescore`) and the rules read
those rewards; the kept lines are then the rescored ones.

Where it runs: inside a Dask worker (`distributed.get_worker()` succeeds) an
input larger than two `partition_mb` partitions is filtered as parallel tasks
(`filter_parallel`); otherwise in one streaming pass in this process, with an
in-memory duplicate set (`filter_rules.SeenSet`). Either way the output is the
same. An input whose prompts are not contiguous is sorted by prompt first
(`filter_scan.sort_by_prompt`); the output is then in (prompt_idx, sample_idx)
order. Every file appears atomically (temporary name, then `os.replace`), so a
stage killed and run again never leaves a half-written output; temporary files
live in `<stage_dir>/.filter-tmp-*` and are removed.

Paths are local (or on a file system every worker mounts): ranges are read
with `seek`.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import time
import uuid
from typing import TYPE_CHECKING, Any, BinaryIO

from stages.filter.rules import RULES, Counts, Rules, SeenSet
from stages.filter.scan import BUFFER, OutOfOrder, filter_range, sort_by_prompt
from stages.lib.devices import in_dask_worker
from stages.lib.io.jsonl import atomic_path, write_json
from stages.lib.io.metrics import Metrics

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.filter import FilterConfig

log = logging.getLogger(__name__)
REPORT = "filter_report.json"
HISTOGRAM = "reward_histogram.png"


def _filter_once(
    cfg: FilterConfig, ctx: StageContext, src: str, tmp: str, out: BinaryIO
) -> tuple[Counts, str, int]:
    """One attempt over `src` (raises `OutOfOrder`); returns counts, mode and partitions."""
    part_bytes = int(cfg.partition_mb * 2**20)
    if in_dask_worker() and os.path.getsize(src) > 2 * part_bytes:
        from distributed import worker_client

        from stages.filter.parallel import run_parallel

        with worker_client() as client:
            counts, parts = run_parallel(client, src, cfg, ctx.pipeline_dir, tmp, out, ctx.log)
        return counts, "parallel", parts
    rules = Rules(cfg, ctx.pipeline_dir)
    counts, _, _ = filter_range(src, 0, None, rules, SeenSet(rules), out)
    return counts, "sequential", 1


def _filter_file(
    cfg: FilterConfig, ctx: StageContext, src: str, out_path: str, tmp: str
) -> tuple[Counts, str, int, bool]:
    """Filter into `out_path`, sorting the input by prompt first when it must."""
    with open(out_path, "wb", buffering=BUFFER) as out:
        try:
            return (*_filter_once(cfg, ctx, src, tmp, out), True)
        except OutOfOrder as exc:
            ctx.log.warning(
                "%s: rows of a prompt are not contiguous (%s); sorting by prompt_idx first",
                src,
                exc,
            )
    sorted_path = sort_by_prompt(src, tmp, int(cfg.partition_mb * 2**20))
    with open(out_path, "wb", buffering=BUFFER) as out:
        return (*_filter_once(cfg, ctx, sorted_path, tmp, out), False)


def _clean_stale(ctx: StageContext, output: str) -> None:
    """Remove what an earlier, killed attempt may have left."""
    for path in glob.glob(ctx.path(".filter-tmp-*")):
        shutil.rmtree(path, ignore_errors=True)
    for path in glob.glob(f"{glob.escape(output)}.tmp-*"):
        os.remove(path)


def run_filter(cfg: FilterConfig, ctx: StageContext) -> dict[str, Any]:
    """Filter `cfg.input` into `cfg.output`; write the report and histogram; return the report."""
    if not cfg.input:
        raise ValueError("filter: no input (set 'input' or give the stage an upstream in 'needs')")
    start = time.perf_counter()
    _clean_stale(ctx, cfg.output)
    tmp = ctx.path(f".filter-tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    out_tmp = f"{cfg.output}.tmp-{uuid.uuid4().hex[:8]}"
    rescored = None
    try:
        src = cfg.input
        if cfg.verifier is not None:  # the rows scored again first (an LLM judge, ...)
            from stages.filter.rescore import rescore

            src, rescored = rescore(cfg.verifier, ctx.run_dir, src, tmp)
        counts, mode, parts, contiguous = _filter_file(cfg, ctx, src, out_tmp, tmp)
        os.replace(out_tmp, cfg.output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(out_tmp):
            os.remove(out_tmp)
    seconds = time.perf_counter() - start
    report = build_report(cfg, counts, mode=mode, partitions=parts, contiguous=contiguous)
    if cfg.pairs:
        report["pairs"] = counts.pairs
    if rescored is not None:
        report["rescored"] = rescored
    report["seconds"] = round(seconds, 3)
    report["rows_per_s"] = round(counts.rows_in / seconds, 1) if seconds > 0 else None
    report["histogram"] = plot_histogram(counts, ctx.path(HISTOGRAM))
    write_json(ctx.path(REPORT), report)
    kept = {"rows_in": counts.rows_in, "rows_kept": counts.rows_kept}
    Metrics(ctx.stage_dir).log(0, {**kept, "dropped": dict(counts.dropped)})
    if cfg.pairs:
        ctx.log.info("filter: %d pairs written to %s", counts.pairs, cfg.output)
    ctx.log.info(
        "filter: kept %d of %d rows (%s) in %.1f s, %s",
        counts.rows_kept,
        counts.rows_in,
        ", ".join(f"{k} {v}" for k, v in counts.dropped.items() if v) or "none dropped",
        seconds,
        f"{parts} partitions on the cluster" if mode == "parallel" else "in one process",
    )
    return report


def build_report(
    cfg: FilterConfig, counts: Counts, *, mode: str, partitions: int, contiguous: bool
) -> dict[str, Any]:
    """The report's counts: every row is in `rows_kept` or under exactly one reason of `dropped`."""
    return {
        "input": cfg.input,
        "output": cfg.output,
        "rows_in": counts.rows_in,
        "rows_kept": counts.rows_kept,
        "rows_dropped": counts.rows_in - counts.rows_kept,
        "dropped": {rule: counts.dropped[rule] for rule in RULES},
        "rule_order": list(RULES),
        "groups_in": counts.groups_in,
        "groups_kept": counts.groups_kept,
        "length_unit": cfg.length_unit,
        "length_fallback_rows": counts.length_fallback,
        "reward_in": counts.rewards_in.summary(),
        "reward_kept": counts.rewards_kept.summary(),
        "input_contiguous": contiguous,
        "mode": mode,
        "partitions": partitions,
    }


def plot_histogram(counts: Counts, path: str) -> str | None:
    """Reward histogram of the input and the kept rows (matplotlib Agg); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("filter: matplotlib is not installed; no reward histogram")
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    hist_in = counts.rewards_in
    if hist_in.n:
        low, high = hist_in.low, hist_in.high
        if low == high:
            low, high = low - 0.5, high + 0.5
        edges = [low + (high - low) * i / 20 for i in range(21)]
        for hist, label in ((hist_in, "input"), (counts.rewards_kept, "kept")):
            if hist.n:
                values, weights = zip(*hist.items(), strict=True)
                ax.hist(values, bins=edges, weights=weights, alpha=0.6, label=f"{label} ({hist.n})")
        ax.legend()
    ax.set_xlabel("reward")
    ax.set_ylabel("rollouts")
    ax.set_title("filter: rewards of input and kept rollouts")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path

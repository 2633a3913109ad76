"""The evaluate stage's body: generate with each checkpoint, verify, compare to a baseline.

Input: a resolved `EvaluateConfig` (`input` the held-out prompt JSONL, `checkpoints` and
`baseline` absolute checkpoint directories, `backend` how to generate: `local` loads each
checkpoint in this process, on the stage's GPU when it holds one; `vllm` serves each in turn
on the stage's GPUs; `openai` asks the served model, which is then the only one evaluated).
Output, in the folder of `cfg.output`: `report.json` (`{"baseline": NAME, "checkpoints":
{NAME: PATH}, "sampling": {...}, "results": [{"checkpoint", "n", "accuracy", "mean_reward",
"pass_at_k"}, ...]}`; `sampling`:
every sampling field each request carried, `stages.lib.api.sampling`), `report.md`,
`report.png` and `generations.jsonl` (every sample with its reward), written by
`stages.evaluate.report_files`. Returns the report plus the accuracy differences and, with a
local backend, the one precision every checkpoint was loaded in (also `settings.json`).

With an `environment`, each checkpoint plays episodes instead (`stages.evaluate.multiturn`):
a result's `accuracy` is then the share of episodes solved within `max_turns`, its
pass@k counts solved episodes, its `mean_reward` is a model turn's mean reward, and it
adds `first_turn_accuracy`, `mean_turns`, `mean_total_reward` and `failed_episodes`;
`generations.jsonl` holds one row per episode; the returned metrics add
`first_turn_accuracy_delta`.

A result's figures (accuracy, pass@k, mean reward) are `stages.evaluate.scores`'; with a
`reward_model`, every sample also gets the reward model's score and each result its mean
`reward_model_score` (`stages.evaluate.reward_scores`). A
checkpoint's NAME is the stage that made it (`@sft` -> `sft`: the engine hands the run's
output paths and their stages over in `StageContext.producers`), otherwise its path
(`checkpoint_names`); `checkpoints` maps each NAME to the path evaluated (as configured: a
GGUF file is converted, and the stage's `chat_template:` applied, in a folder of the run's
`.pipe-models/` that generation loads: `stages.lib.model.prepared`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stages.evaluate.multiturn import Play
from stages.evaluate.report_files import write_report
from stages.evaluate.scores import summarize
from stages.lib.api.sampling import request_sampling
from stages.lib.io.jsonl import read_jsonl, write_json
from stages.lib.io.metrics import Metrics

if TYPE_CHECKING:
    from engine.stage import StageContext
    from stages.evaluate import EvaluateConfig
    from stages.lib.backends.endpoint import Endpoint

log = logging.getLogger("pipe.stages.evaluate")

Verify = Callable[[dict[str, Any], str], float]


def run_evaluate(cfg: EvaluateConfig, ctx: StageContext) -> dict[str, Any]:
    """Evaluate every checkpoint on the held-out prompts and write the report."""
    from stages.lib.verify import make_verifier

    if not cfg.input:
        raise ValueError("evaluate needs an 'input' prompt file (e.g. '@data.test_output')")
    served = cfg.backend.SERVES_OWN_MODEL
    if not cfg.checkpoints and not served:
        raise ValueError("evaluate needs at least one checkpoint in 'checkpoints'")
    rows = list(read_jsonl(cfg.input))[: cfg.limit]
    checkpoints = [str(cfg.backend.model)] if served else cfg.checkpoints
    generate = Generator(cfg, ctx)
    verify = make_verifier(cfg.verifier, ctx.run_dir)
    report = evaluate_checkpoints(
        cfg,
        list(checkpoints),
        cfg.baseline,
        rows,
        verify,
        ctx.run_dir,
        generate,
        producers=ctx.producers,
        pipeline_dir=ctx.pipeline_dir,
    )
    if hasattr(verify, "close"):  # a served judge's connections
        verify.close()
    counts = getattr(verify, "counts", None)
    if counts is not None:  # a judge's requests, cache hits and unscored answers
        report["judge"] = counts()
    Metrics(ctx.stage_dir).log(0, {**tracked(report), **report.get("judge", {})})
    return report


def tracked(report: dict[str, Any]) -> dict[str, Any]:
    """The report's figures per checkpoint, for the run's trackers: accuracy, mean reward,
    pass@k, and each checkpoint's accuracy delta to the baseline."""
    out: dict[str, Any] = {}
    for r in report.get("results", []):
        name = r["checkpoint"]
        out[f"accuracy/{name}"] = r["accuracy"]
        out[f"mean_reward/{name}"] = r["mean_reward"]
        if "reward_model_score" in r:
            out[f"reward_model_score/{name}"] = r["reward_model_score"]
        out.update({f"pass@{k}/{name}": v for k, v in r.get("pass_at_k", {}).items()})
    out.update({f"accuracy_delta/{k}": v for k, v in report.get("accuracy_delta", {}).items()})
    return out


class Generator:
    """Answers of one checkpoint to every prompt, through the configured backend."""

    def __init__(self, cfg: EvaluateConfig, ctx: StageContext | None = None) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.dtype: str | None = None  # local: the one precision of every checkpoint

    def set_precision(self, paths: Sequence[str]) -> dict[str, str] | None:
        """A local backend loads every checkpoint in one dtype (`backend.precision`,
        `stages.lib.model.dtypes.resolve_precision`), recorded in the stage's `settings.json`; the
        dtype and why (None: another backend, which loads nothing here)."""
        loaded = self.cfg.backend.load_dtype(paths)
        if loaded is None:
            return None
        from stages.lib.chat.clock import dated

        self.dtype, why = loaded
        log.info("every checkpoint loaded in %s (%s)", self.dtype, why)
        record = {"dtype": self.dtype, "why": why}
        if self.ctx is not None:
            settings = {"backend.precision": record, **dated(self.ctx)}
            write_json(f"{self.ctx.stage_dir}/settings.json", settings)
        return record

    def __call__(self, path: str, prompts: list[Any], num_samples: int) -> list[list[Answer]]:
        cfg, engine = self.cfg, self.cfg.backend.in_process()
        if engine is not None:
            from stages.lib.devices import torch_device

            return [
                [Answer(g.text, g.finish_reason, g.completion_tokens) for g in sample]
                for sample in engine.generate(
                    path,
                    prompts,
                    num_samples=num_samples,
                    temperature=cfg.temperature,
                    top_p=1.0,
                    max_new_tokens=cfg.max_output_tokens,
                    seed=cfg.seed,
                    device=torch_device(self.ctx),
                    dtype=self.dtype,
                )
            ]
        return self._http(path, prompts, num_samples)

    @contextmanager
    def endpoint(self, path: str) -> Iterator[Endpoint]:
        """The HTTP endpoint answering as `path` (a server the backend starts: for the block's
        duration)."""
        from stages.lib.backends.endpoint import Serving

        backend = self.cfg.backend.serving(path)
        gpus = len(self.ctx.devices()) if self.ctx is not None else 0
        visible = self.ctx.device_env().get("CUDA_VISIBLE_DEVICES") if self.ctx else None
        devices = visible.split(",") if visible else None
        env = self.cfg.environment
        parser = env.tool_call_parser if env is not None else None
        from stages.lib.devices import torch_device

        serving = Serving(log, gpus, devices, None, parser, torch_device(self.ctx))
        with backend.open_endpoint(serving) as endpoint:
            yield endpoint

    def _http(self, path: str, prompts: list[Any], num_samples: int) -> list[list[Answer]]:
        import asyncio

        from stages.lib.api.client import complete_all
        from stages.lib.backends.endpoint import make_client

        with self.endpoint(path) as endpoint:
            client = make_client(self.cfg, endpoint, connections=64)
            done = asyncio.run(
                complete_all(client, prompts, num_samples=num_samples, seed=self.cfg.seed)
            )
        return [[Answer(c.text, c.finish_reason, c.completion_tokens) for c in s] for s in done]


@dataclass(frozen=True)
class Answer:
    """One generated answer, whichever backend made it."""

    text: str
    finish_reason: str
    completion_tokens: int


def evaluate_checkpoints(
    cfg: EvaluateConfig,
    checkpoints: list[str],
    baseline: str | None,
    rows: list[dict[str, Any]],
    verify: Verify,
    run_dir: str,
    generate: Generator | None = None,
    *,
    producers: Mapping[str, str] | None = None,
    pipeline_dir: str = "",
) -> dict[str, Any]:
    """Generate, score and report; `cfg` gives the sampling settings and the output path;
    `producers` and `pipeline_dir` name the checkpoints (`checkpoint_names`)."""
    generate = generate or Generator(cfg)
    paths = _with_baseline(checkpoints, baseline)
    names = checkpoint_names(paths, run_dir, producers, pipeline_dir)
    ctx = getattr(generate, "ctx", None)
    stage_log = ctx.log if ctx is not None else log  # where a conversion's lines go
    served = _prepared(cfg, paths, run_dir, stage_log)
    precision = generate.set_precision(served)
    # the environment is loaded before any checkpoint: a bad one fails at once
    play = (
        Play(cfg, generate.ctx, generate.endpoint, generate.dtype)
        if cfg.environment is not None
        else None
    )
    results, samples = [], []
    try:
        for path, name in zip(served, names, strict=True):
            if play is not None:
                solved, fields, gen_rows = play(path, name, rows)
                result = {**summarize(name, solved), **fields}
            else:
                rewards, gen_rows = _score_checkpoint(cfg, path, name, rows, verify, generate)
                result = summarize(name, rewards)
            results.append(result)
            samples.extend(gen_rows)
            log.info("%s: accuracy %.3f on %d prompts", name, result["accuracy"], len(rows))
    finally:
        if play is not None:
            play.close()  # an environment served by a process stops here
    if cfg.reward_model is not None:
        from stages.evaluate.reward_scores import SCORE, score_samples
        from stages.lib.devices import torch_device

        means = score_samples(cfg.reward_model, rows, samples, torch_device(generate.ctx))
        for result in results:
            result[SCORE] = means.get(result["checkpoint"], 0.0)
    # every backend samples with these: HTTP requests carry them all (`stages.lib.api.sampling`)
    sampling = request_sampling(cfg.temperature, cfg.top_p, cfg.backend.VLLM_SAMPLING)
    report = {
        "baseline": names[0],
        "checkpoints": dict(zip(names, paths, strict=True)),
        "sampling": sampling,
        "results": results,
    }
    write_report(cfg.output, report, samples)
    out = {**report, "accuracy_delta": _deltas(results, "accuracy")}
    if precision is not None:  # the metrics' and settings.json's, not the report's
        out["precision"] = precision
    if play is not None:
        out["first_turn_accuracy_delta"] = _deltas(results, "first_turn_accuracy")
    return out


def _prepared(
    cfg: EvaluateConfig, paths: list[str], run_dir: str, logger: logging.Logger = log
) -> list[str]:
    """The folder each checkpoint is loaded or served from: a GGUF converted (its lines to
    `logger`, the stage's log), the stage's `chat_template:` applied
    (`stages.lib.model.prepared`); an openai backend's model as named."""
    if cfg.backend.SERVES_OWN_MODEL:
        return paths
    from stages.lib.model.prepared import prepare_model, stage_template

    dtype, template = cfg.backend.gguf_dtype(), stage_template(cfg)
    return [
        prepare_model(p, run_dir=run_dir, dtype=dtype, template=template, log=logger) for p in paths
    ]


def _deltas(results: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Each checkpoint's `key` less the baseline's (the first result)."""
    return {r["checkpoint"]: r[key] - results[0][key] for r in results}


def _with_baseline(checkpoints: list[str], baseline: str | None) -> list[str]:
    """The checkpoints to evaluate, the baseline first."""
    if baseline is None:
        return list(checkpoints)
    same = [c for c in checkpoints if os.path.realpath(c) == os.path.realpath(baseline)]
    rest = [c for c in checkpoints if c not in same]
    return [same[0] if same else baseline, *rest]


def checkpoint_names(
    paths: Sequence[str],
    run_dir: str,
    producers: Mapping[str, str] | None = None,
    pipeline_dir: str = "",
) -> list[str]:
    """Labels: the stage that made the checkpoint (`producers`, the run's output paths ->
    their reference without '@': `@sft` -> `sft`; or its folder `<run-dir>/<stage>/<dir>`),
    else its path: relative to the pipeline's folder when under it, else absolute (a hub id
    or a served model's name as it is); made unique."""
    made = {os.path.realpath(k): v for k, v in (producers or {}).items()}
    root = os.path.realpath(run_dir) if run_dir else None
    names: list[str] = []
    for p in paths:
        real = os.path.realpath(p) if os.path.isabs(p) else None
        if real is None:
            name = p
        elif real in made:
            name = made[real]
        elif root is not None and os.path.dirname(os.path.dirname(real)) == root:
            name = os.path.basename(os.path.dirname(real))
        else:
            rel = os.path.relpath(p, pipeline_dir) if pipeline_dir else ".."
            name = os.path.normpath(p) if rel.startswith("..") else rel
        base, n = name, 2
        while name in names:
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


def _score_checkpoint(
    cfg: EvaluateConfig,
    path: str,
    name: str,
    rows: list[dict[str, Any]],
    verify: Verify,
    generate: Generator,
) -> tuple[list[list[float]], list[dict[str, Any]]]:
    prompts = [r["messages"] if "messages" in r else r["prompt"] for r in rows]
    greedy = cfg.temperature == 0
    if greedy and cfg.num_samples > 1:
        log.warning("temperature 0 gives %d identical samples; generating one", cfg.num_samples)
    gens = generate(path, prompts, 1 if greedy else cfg.num_samples)
    pairs = [(row, g.text) for row, samples in zip(rows, gens, strict=True) for g in samples]
    scored = _verified(verify, pairs)
    rewards: list[list[float]] = []
    out: list[dict[str, Any]] = []
    for idx, (row, samples) in enumerate(zip(rows, gens, strict=True)):
        mine = [next(scored) for _ in samples]
        kept = [r for r in mine if not isinstance(r, Exception)]
        if kept:  # a prompt whose every answer the judge left unscored is left out
            rewards.append(kept)
        for s, (g, r) in enumerate(zip(samples, mine, strict=True)):
            out.append(
                {
                    "checkpoint": name,
                    "prompt_idx": idx,
                    "sample_idx": s,
                    "completion": g.text,
                    "reward": None if isinstance(r, Exception) else r,
                    **({"verify_error": str(r)} if isinstance(r, Exception) else {}),
                    "finish_reason": g.finish_reason,
                    "completion_tokens": g.completion_tokens,
                    "answer": row.get("answer"),
                }
            )
    return rewards, out


def _verified(
    verify: Verify, pairs: list[tuple[dict[str, Any], str]]
) -> Iterator[float | Exception]:
    """Each pair's reward; a judge (`stages.lib.judge`) grades them all at once, and an answer
    it leaves unscored is its `Unjudged` error: that sample is out of the accuracy, its row's
    reward null (a counted failure, not a zero)."""
    many = getattr(verify, "score_many", None)
    if many is not None:
        return iter(many(pairs))
    return iter([float(verify(row, text)) for row, text in pairs])

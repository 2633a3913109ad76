"""The rl stage's episodes: the one-turn case is today's rollout, number for number; a
multi-turn episode's observation tokens carry no loss (exactly zero gradient at their
logits); an environment that breaks fails its episodes, not the step, under the threshold."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stages.lib.builders.recipe import TinyModel  # noqa: E402
from stages.lib.builders.tiny import build_tiny_model  # noqa: E402
from stages.lib.config import Verifier  # noqa: E402
from stages.lib.env.contract import environment_factory  # noqa: E402
from stages.lib.env.field import EnvironmentConfig  # noqa: E402
from stages.lib.verify import make_verifier  # noqa: E402
from stages.rl import RLConfig  # noqa: E402
from stages.rl.rollout.prompts import Stream  # noqa: E402

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 300}
ROWS = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(4) for b in range(3)]
EXACT = Verifier(kind="exact_match")
CHANCE = Verifier(kind="regex", pattern="[0-4]")  # the untrained model's luck: some right


class OneTurn:
    """A user environment that is the exact_match verifier's one turn."""

    def __init__(self) -> None:
        self.score = make_verifier(EXACT)

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.row = row
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, messages: Any, completion: str) -> tuple[float, None, bool]:
        return self.score(self.row, completion), None, True


class Flaky(OneTurn):
    """Breaks every episode whose row asks about 0 (`how`: raise, nan, text, hang)."""

    def __init__(self, how: str = "raise") -> None:
        super().__init__()
        self.how = how

    async def step(self, messages: Any, completion: str) -> Any:
        if not self.row["prompt"].startswith("0 "):
            return await super().step(messages, completion)
        if self.how == "raise":
            raise RuntimeError("the sandbox is down")
        if self.how == "nan":
            return math.nan, None, True
        if self.how == "hang":
            import asyncio

            await asyncio.sleep(3600)
        return "correct"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from stages.rl.rollout.local import LocalEngine

    folder = tmp_path_factory.mktemp("m")
    texts = [f"{r['prompt']} {r['answer']}" for r in ROWS] * 5 + ["wrong, try again"] * 5
    build_tiny_model(TinyModel(**TINY), texts, str(folder), seed=0)
    torch.manual_seed(0)
    return LocalEngine(str(folder))


def controller(
    engine: Any, environment: dict[str, Any] | None = None, verifier: Verifier = EXACT, **cfg: Any
) -> Any:
    # no refills (dynamic sampling is off by default): the oracle below is the step's rollout
    settings = {"num_repeats": 4, "rollout_batch_size": 6, "max_output_tokens": 6} | cfg
    config = RLConfig(
        input="x.jsonl",
        verifier=verifier,
        environment=EnvironmentConfig(**environment) if environment else None,
        **settings,
    )
    return SimpleNamespace(
        cfg=config,
        engine=engine,
        data=SimpleNamespace(rows=ROWS),
        stream=Stream(len(ROWS), config.rollout_batch_size, config.seed),
        make_env=environment_factory(config.environment, config.verifier),
        version=3,
        reward=None,  # no reward model: the verifier scores
        ctx=SimpleNamespace(log=logging.getLogger("test")),
        evals=SimpleNamespace(rows=ROWS),
        first_turn=None,
    )


def todays_rollout(c: Any, step: int) -> tuple[list[Any], list[list[float]]]:
    """The one-turn rollout as it was before episodes: the oracle for the one-turn case."""
    from stages.rl.algo.loss import group_advantages

    cfg, indices = c.cfg, c.stream.indices(step)
    gens = c.engine.generate(
        [ROWS[i]["prompt"] for i in indices],
        num_samples=cfg.num_repeats,
        temperature=cfg.temperature,
        max_new_tokens=cfg.max_output_tokens,
        seed=cfg.seed * 1_000_003 + step,
        batch_size=256,
    )
    verify = make_verifier(EXACT)
    rewards = [[verify(ROWS[i], g.text) for g in gs] for i, gs in zip(indices, gens, strict=True)]
    adv, keep = group_advantages(torch.tensor(rewards, dtype=torch.float64))
    out = []
    for g_idx, gs in enumerate(gens):
        for s_idx, g in enumerate(gs):
            if keep[g_idx]:
                ids = (g.prompt_ids + g.token_ids)[: cfg.max_length]
                n = len(ids) - len(g.prompt_ids)
                out.append((ids, g.logprobs[:n], float(adv[g_idx, s_idx])))
    return out, rewards


@pytest.mark.parametrize("environment", [None, {"kind": f"{__name__}:OneTurn", "max_turns": 1}])
def test_one_turn_episodes_are_todays_rollout(engine: Any, environment: Any):
    from stages.rl.controller.batch import rollout

    c = controller(engine, environment)
    for step in (1, 2):
        expected, rewards = todays_rollout(c, step)
        batch = rollout(c, step)
        assert batch.rewards == rewards
        got = [(s.ids, s.old_logprobs, s.advantage) for s in batch.samples]
        assert [g[0] for g in got] == [e[0] for e in expected]
        for (_, lp, adv), (_, lp_e, adv_e) in zip(got, expected, strict=True):
            assert lp == pytest.approx(lp_e, abs=1e-6) and adv == pytest.approx(adv_e)
        assert all(not s.mask and s.version == 3 for s in batch.samples)
        assert batch.turns == 1.0 and batch.failed == 0


def test_retry_episodes_mask_the_feedback_and_give_a_second_turn(engine: Any):
    from stages.rl.controller.batch import rollout

    c = controller(engine, {"kind": "retry"}, CHANCE, temperature=1.5)
    batch = rollout(c, 1)
    second = [s for s in batch.samples if s.mask]
    assert second, "some episodes took a second turn"
    tok = engine.tokenizer
    for s in second:
        completion = s.ids[s.prompt_len :]
        assert len(s.mask) == len(completion) == len(s.old_logprobs)
        # the first answer is trained as far as the template's rendering of it is the ids
        # sampled: a cut one is closed as the template closes it, outside the loss, and a
        # random model's answer that re-tokenises otherwise keeps the rest outside too
        mask = list(s.mask)
        i = mask.index(0)
        j = i + mask[i:].index(1)
        assert all(mask[j:])
        closed = i > 0 and completion[i - 1] == tok.convert_tokens_to_ids("<|eos|>")
        shown = tok.decode(completion[i:j], skip_special_tokens=False).replace(" ", "")
        assert shown.endswith("<|user|>wrong,tryagain<|assistant|>")
        if closed:
            assert shown == "<|user|>wrong,tryagain<|assistant|>"
        else:
            assert "<|eos|><|user|>" in shown
        assert all(lp == 0.0 for lp, m in zip(s.old_logprobs, s.mask, strict=True) if not m)
        assert all(lp < 0.0 for lp, m in zip(s.old_logprobs, s.mask, strict=True) if m)
        assert s.reward in (-1.0, 0.5)  # wrong twice, or right at the second turn
    assert 1.0 < batch.turns <= 2.0


def test_observation_positions_get_exactly_zero_gradient(engine: Any):
    """The actor's loss (`masked_policy_terms` over `completion_logprobs`) on a two-turn
    sample: d loss / d logits is zero at every position predicting an observation token,
    and not at the positions predicting the model's own tokens."""
    from stages.rl.algo.logprobs import Sample, completion_logprobs
    from stages.rl.algo.loss import masked_policy_terms

    c = controller(engine, {"kind": "retry"}, CHANCE, temperature=1.5)
    from stages.rl.controller.batch import rollout

    sample = next(s for s in rollout(c, 1).samples if s.mask)
    sample = Sample(**{**sample.__dict__, "advantage": 1.0})
    model = engine.model
    captured: dict[str, Any] = {}

    def call(**kw: Any) -> Any:
        out = model(**kw)
        out.logits.retain_grad()
        captured["logits"], captured["start"] = out.logits, kw["input_ids"].shape[1]
        return out

    new, _ = completion_logprobs(model, [sample], "cpu", 1.0, engine.pad_id, call=call)
    new_t = torch.cat(new)
    old = torch.tensor(sample.old_logprobs)
    loss, _, _ = masked_policy_terms(
        new_t,
        old,
        torch.full_like(new_t, 1.0),
        torch.tensor(sample.loss_mask()),
        0.2,
        ref=new_t.detach() - 0.1,
        kl_coef=0.5,
    )
    loss.backward()
    logits = captured["logits"]
    grad = logits.grad[0]
    offset = len(sample.ids) - logits.shape[1]  # logits kept from this position on
    for k, m in enumerate(sample.mask):
        row = grad[sample.prompt_len - 1 + k - offset]  # the position predicting token k
        if m:
            assert row.abs().sum() > 0
        else:
            assert torch.equal(row, torch.zeros_like(row))
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("how", ["raise", "nan", "text", "hang"])
def test_a_broken_environment_fails_episodes_not_the_step(engine: Any, how: str):
    from stages.rl.controller.batch import rollout

    env = {"kind": f"{__name__}:Flaky", "max_turns": 1, "config": {"how": how}, "timeout_s": 0.5}
    # every step's rows: 2 of 12 prompts start with "0 ": a sixth of the episodes at most
    c = controller(engine, {**env, "max_failed_share": 0.5}, rollout_batch_size=12)
    batch = rollout(c, 1)
    assert batch.failed == 3 * 4  # the three rows "0 + b" x 4 samples
    assert all(
        not ROWS[i]["prompt"].startswith("0 ") or not r
        for i, r in zip(batch.indices, batch.rewards, strict=True)
    )
    strict = controller(engine, {**env, "max_failed_share": 0.1}, rollout_batch_size=12)
    with pytest.raises(RuntimeError, match=r"12 of 48 episodes failed \(25%\), above"):
        rollout(strict, 1)


def test_held_out_reports_solved_and_first_turn(engine: Any):
    from stages.rl.controller.batch import held_out

    c = controller(engine, {"kind": "retry"})
    solved = held_out(c)
    assert 0.0 <= c.first_turn <= solved <= 1.0
    plain = controller(engine)
    assert held_out(plain) == plain.first_turn  # one turn: the two are the same


def test_the_retry_environment_is_planned_with_grpo_only(tmp_path: Path):
    from tests.conftest import run_cli

    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        "name: p\nstages:\n  rl:\n    kind: rl\n    config:\n      input: d.jsonl\n"
        "      algorithm: ppo\n      environment: {kind: retry}\n"
    )
    out = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert out.exit_code == 2
    assert (
        "p.yaml:8:27: stages.rl.config.environment.kind: multi-turn episodes train with GRPO only"
        in out.stderr
    )


@pytest.mark.parametrize(
    ("environment", "extra", "line"),
    [
        (
            '{kind: "no_such_module.envs:Game", max_turns: 3}',
            "",
            "p.yaml:7:27: stages.s.config.environment.kind: environment "
            "'no_such_module.envs:Game': no module named 'no_such_module'",
        ),
        (
            '{kind: "tests.unit.test_rl_env:OneTurn"}',
            "",
            "p.yaml:7:27: stages.s.config.environment.kind: an environment of your own "
            "(kind 'module:Class', verifiers or url) needs 'max_turns'",
        ),
        (
            "{url: 'http://127.0.0.1:9/env', max_turns: 2}",
            "      verifier: {kind: exact_match}\n",
            "p.yaml:8:24: stages.s.config.verifier.kind: the environment (p.yaml:7:26) scores "
            "the episodes itself, so this verifier would be ignored",
        ),
        (
            "{kind: retri}",
            "",
            "p.yaml:7:27: stages.s.config.environment.kind: expected 'single_turn', 'retry', "
            "'calculator', 'python', 'nemo_gym', 'verifiers' or 'module:Class', found 'retri'; did you mean 'retry'?",
        ),
    ],
)
@pytest.mark.parametrize("kind", ["rl", "collect", "evaluate"])
def test_validate_refuses_an_environment_it_could_not_run(
    tmp_path: Path, kind: str, environment: str, extra: str, line: str
):
    from tests.conftest import run_cli

    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    backend = {
        "rl": "",
        "collect": "      backend: {kind: openai, base_url: 'http://127.0.0.1:9/v1', model: m}\n",
        "evaluate": "      backend: {kind: openai, base_url: 'http://127.0.0.1:9/v1', model: m}\n",
    }[kind]
    (tmp_path / "p.yaml").write_text(
        f"name: p\nstages:\n  s:\n    kind: {kind}\n    config:\n      input: d.jsonl\n"
        f"      environment: {environment}\n{extra}{backend}"
    )
    out = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert out.exit_code == 2, out.stdout
    assert line in out.stderr, out.stderr

"""The rl stage's algorithm settings (issue 39): each estimator and loss formula on small
tensors against a worked example, DAPO's dynamic sampling (bounded, never trains a group
whose rewards agree) on a real tiny engine, and every setting refused at validate or
recorded as skipped where it cannot act."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stages.lib.builders.recipe import TinyModel  # noqa: E402
from stages.lib.builders.tiny import build_tiny_model  # noqa: E402
from stages.lib.config import Verifier  # noqa: E402
from stages.lib.env.contract import environment_factory  # noqa: E402
from stages.rl import RLConfig  # noqa: E402
from stages.rl.algo.advantage import (  # noqa: E402
    group_estimate,
    overlong_penalty,
    reinforce_pp_returns,
)
from stages.rl.algo.effects import account_algorithm  # noqa: E402
from stages.rl.algo.loss import (  # noqa: E402
    clipped_policy_loss,
    masked_policy_terms,
    sequence_log_ratio,
    token_scale,
)
from stages.rl.rollout.prompts import Stream  # noqa: E402

# --- estimators ------------------------------------------------------------------------


def test_grpo_dr_grpo_and_rloo_on_one_group():
    """Rewards [0, 0, 0, 1]: mean 0.25, deviations -0.25 (x3) and 0.75, squares summing to
    3/16 + 9/16 = 0.75, so the sample std (n - 1 = 3, verl's and TRL's) is sqrt(0.25) = 0.5.
    GRPO (DeepSeekMath eq. 3): (r - mean) / std = -0.5 (x3), 1.5; Dr. GRPO: r - mean; RLOO
    (Ahmadian et al. eq. 6): r_i minus the mean of the other three: 1 - 0 = 1 for the right
    answer, 0 - 1/3 for each wrong one."""
    rewards = [0.0, 0.0, 0.0, 1.0]
    grpo, signal = group_estimate(rewards, "grpo", True)
    assert signal
    assert grpo == pytest.approx([-0.5, -0.5, -0.5, 1.5], abs=1e-5)
    dr, _ = group_estimate(rewards, "dr_grpo", True)  # std_normalize does not act on it
    assert dr == pytest.approx([-0.25, -0.25, -0.25, 0.75])
    rloo, _ = group_estimate(rewards, "rloo", True)
    assert rloo == pytest.approx([-1 / 3, -1 / 3, -1 / 3, 1.0])
    # grpo with std_normalize off is Dr. GRPO
    assert group_estimate(rewards, "grpo", False)[0] == pytest.approx(dr)


def test_grpo_divides_by_the_sample_std_as_verl_and_trl():
    """verl (`compute_grpo_outcome_advantage`) and TRL (GRPOTrainer) divide by `torch.std`,
    the sample std (n - 1). Rewards [0, 1, 2]: mean 1, squares 1 + 0 + 1 = 2, over n - 1 = 2:
    std 1, so advantages -1, 0, 1 (the population std, sqrt(2/3), would give +-1.22).
    Rewards [0, 1]: squares 0.25 + 0.25 = 0.5 over 1: std sqrt(0.5), advantages -+sqrt(0.5).
    A group of one (its siblings failed) has no spread: no signal, no NaN."""
    assert group_estimate([0.0, 1.0, 2.0], "grpo", True)[0] == pytest.approx(
        [-1.0, 0.0, 1.0], abs=1e-5
    )
    assert group_estimate([0.0, 1.0], "grpo", True)[0] == pytest.approx(
        [-(0.5**0.5), 0.5**0.5], abs=1e-5
    )
    assert group_estimate([1.0], "grpo", True) == ([0.0], False)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_a_group_whose_rewards_agree_carries_no_signal(kind: str):
    adv, signal = group_estimate([1.0, 1.0, 1.0], kind, True)
    assert not signal
    if kind != "reinforce_pp":
        assert adv == [0.0, 0.0, 0.0]


def test_reinforce_pp_returns_with_a_per_token_kl_normalised_over_the_batch():
    """Two answers, rewards 1 and 0, of 2 and 1 tokens; kl_coef 0.1, k1 per token
    `old - ref`: 0.5 and -1.0 on the first answer, 0 on the second. Token rewards
    [-0.05, 0.1 + 1] and [0]; returns (sum from each token on) [1.05, 1.1] and [0]; over
    the batch's three tokens mean 0.71667, std 0.50715: [0.6572, 0.7558] and [-1.4131]."""
    out = reinforce_pp_returns(
        [1.0, 0.0],
        [[-1.0, -2.0], [-0.5]],
        [[-1.5, -1.0], [-0.5]],
        [[1.0, 1.0], [1.0]],
        kl_coef=0.1,
    )
    assert out[0] == pytest.approx([0.65724, 0.75583], abs=1e-4)
    assert out[1] == pytest.approx([-1.41307], abs=1e-4)
    # an observation token (mask 0) has no KL reward, no advantage, and is not in the stats
    masked = reinforce_pp_returns(
        [1.0, 0.0], [[-1.0, 0.0, -2.0], [-0.5]], [[-1.5, -9.0, -1.0], [-0.5]],
        [[1.0, 0.0, 1.0], [1.0]], kl_coef=0.1,
    )  # fmt: skip
    assert masked[0][1] == 0.0
    assert [masked[0][0], masked[0][2], masked[1][0]] == pytest.approx(
        [out[0][0], out[0][1], out[1][0]], abs=1e-4
    )


def test_dapo_overlong_penalty_at_the_papers_lengths():
    """DAPO's eq. 13 with L_max 20,480 and L_cache 4,096 (its training setting)."""
    assert overlong_penalty(16_384, 20_480, 4_096, 1.0) == 0.0
    assert overlong_penalty(18_432, 20_480, 4_096, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(20_480, 20_480, 4_096, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(20_480, 20_480, 4_096, 0.5) == pytest.approx(-0.5)


# --- the loss --------------------------------------------------------------------------


def test_clip_higher_lets_a_good_tokens_ratio_rise_further():
    """Ratio e^0.25 = 1.284 on a positive advantage: clipped at 1.2 by eps_clip 0.2, at 1.28
    with eps_clip_high 0.28; a falling ratio (0.7, negative advantage) is clipped at 0.8
    either way."""
    new, old = torch.tensor([0.25, -0.3567]), torch.zeros(2)
    adv = torch.tensor([1.0, -1.0])
    sym, _ = clipped_policy_loss(new, old, adv, 0.2)
    high, clipped = clipped_policy_loss(new, old, adv, 0.2, eps_clip_high=0.28)
    assert sym.tolist() == pytest.approx([-1.2, 0.8], abs=1e-4)
    assert high.tolist() == pytest.approx([-1.28, 0.8], abs=1e-4)
    assert clipped.tolist() == [1.0, 1.0]


def test_gspo_ratio_is_each_sequences_geometric_mean_clipped_as_one():
    """Log-ratios [0.2, 0.4] and [-0.1]: the first sequence's ratio exp(0.3) on both its
    tokens, the second's exp(-0.1); an observation token (mask 0) does not count."""
    new = torch.tensor([0.2, 0.4, -0.1], requires_grad=True)
    log_ratio = sequence_log_ratio(new, torch.zeros(3), torch.ones(3), [2, 1])
    assert log_ratio.tolist() == pytest.approx([0.3, 0.3, -0.1])
    masked = sequence_log_ratio(new, torch.zeros(3), torch.tensor([1.0, 0.0, 1.0]), [2, 1])
    assert masked.tolist() == pytest.approx([0.2, 0.2, -0.1])
    # clipped per sequence: exp(0.3) = 1.35 > 1.2 on a positive advantage bounds both tokens
    loss, _, clipped = masked_policy_terms(
        new, torch.zeros(3), torch.ones(3), torch.ones(3), 0.2, lengths=[2, 1]
    )
    assert clipped.item() == 2.0
    loss.backward()
    assert new.grad is not None and new.grad[:2].abs().sum().item() == 0.0  # clipped: no grad


def _planned_rl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str) -> Any:
    """The rl stage's config as `pipe plan` resolves it from `config` (defaults, derived)."""
    from engine.load.load import load_pipeline
    from engine.plan.dag import plan
    from engine.resolve.resolve import resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        f"name: p\nstages:\n  rl:\n    kind: rl\n    config: {{input: d.jsonl, {config}}}\n"
    )
    return plan(resolve(load_pipeline("p.yaml", ()), run_dir="runs/p")).stages["rl"].resolved.config


def _gspo_gradient(cfg: Any) -> list[float]:
    """d(step loss)/d(new log-prob) per token, as the actor's update computes it from `cfg`
    (`stages.rl.roles.policy_update`: token_scale, then masked_policy_terms over the step's
    divisor): three sequences of 1, 2 and 1 tokens, old log-probs 0, new ones [0], [2e-4, 0],
    [1e-3], advantages +1, -1, +1."""
    new = torch.tensor([0.0, 2e-4, 0.0, 1e-3], dtype=torch.float64, requires_grad=True)
    zero, ones = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    weights, divisor = token_scale(cfg.loss_agg, [(1, 1), (2, 2), (1, 1)], sequences=3, tokens=4)
    scale = None if weights is None else torch.tensor(weights, dtype=torch.float64)
    loss, _, _ = masked_policy_terms(
        new,
        zero,
        adv,
        ones,
        cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high,
        lengths=[1, 2, 1] if cfg.ratio_level == "sequence" else None,
        scale=scale,
    )
    (loss / divisor).backward()
    assert new.grad is not None
    return [float(g) for g in new.grad]


def test_gspo_is_one_choice_that_brings_its_aggregation_and_clip_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`ratio_level: sequence` alone resolves GSPO's loss (Zheng et al., 2025, eq. 5): the
    mean over G sequences of each one's token mean of -min(s A, clip(s, 1 - 3e-4, 1 + 4e-4) A),
    s = exp(mean_t (new - old)). Worked by hand, with N = 3 sequences:
    - [0], A = +1: s = 1, inside the range: loss -s, d/dnew = -(1/3)(s / 1) = -1/3;
    - [2e-4, 0], A = -1: s = e^1e-4 = 1.0001, inside: each token's loss is s, the sequence's
      mean s, d/dnew_t = (1/3) ds/dnew_t = (1/3)(s / 2) = s / 6 on both tokens;
    - [1e-3], A = +1: s = e^1e-3 = 1.0010 > 1.0004: the clipped term is the min, gradient 0.
    The same ratio with the plain defaults (token_mean over 4 tokens, clip 0.2) gives
    -1/4, s/4, s/4 and -e^1e-3/4: every value differs."""
    import math

    cfg = _planned_rl(tmp_path, monkeypatch, "ratio_level: sequence")
    assert (cfg.loss_agg, cfg.eps_clip, cfg.eps_clip_high) == ("seq_mean_token_mean", 3e-4, 4e-4)
    s = math.exp(1e-4)
    assert _gspo_gradient(cfg) == pytest.approx([-1 / 3, s / 6, s / 6, 0.0], abs=1e-12)
    # each overridable: what the user sets is kept
    own = _planned_rl(
        tmp_path,
        monkeypatch,
        "ratio_level: sequence, loss_agg: token_mean, eps_clip: 0.2, eps_clip_high: 0.2",
    )
    assert (own.loss_agg, own.eps_clip, own.eps_clip_high) == ("token_mean", 0.2, 0.2)
    expected = [-1 / 4, s / 4, s / 4, -math.exp(1e-3) / 4]
    assert _gspo_gradient(own) == pytest.approx(expected, abs=1e-12)
    # Dr. GRPO refuses seq_mean_token_mean: GSPO brings its clip range only
    dr = _planned_rl(tmp_path, monkeypatch, "ratio_level: sequence, advantage: dr_grpo")
    assert (dr.loss_agg, dr.eps_clip, dr.eps_clip_high) == ("token_mean", 3e-4, 4e-4)
    # settings.json says why each is what it is
    how = account_algorithm(cfg)
    assert how["loss_agg"][1].endswith(
        "(GSPO's: with ratio_level sequence each sequence weighs the same, as the paper's)"
    )
    assert "(GSPO's range: a sequence's ratio, a geometric mean" in how["eps_clip"][1]
    assert "(GSPO's range" in how["eps_clip_high"][1]
    assert "GSPO" not in account_algorithm(own)["loss_agg"][1]


def test_plan_explains_gspo_s_settings_as_derived_and_warns_on_a_wide_clip(tmp_path: Path):
    from tests.conftest import run_cli

    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        "name: p\nstages:\n  rl:\n    kind: rl\n    config: {input: d.jsonl, "
        "ratio_level: sequence}\n"
    )
    out = run_cli("plan", "p.yaml", "--explain", cwd=tmp_path)
    assert out.exit_code == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    rule = "<- rule: ratio_level sequence (GSPO, Zheng et al. 2025): "
    assert lines["loss_agg"].split(None, 2)[1:] == [
        '"seq_mean_token_mean"',
        rule + "each sequence weighs the same, its loss the mean over its tokens, as the "
        "paper's objective and verl's GSPO recipe (token_mean would weigh it by its length)",
    ]
    assert lines["eps_clip"].split(None, 2)[1:] == [
        "0.0003",
        rule + "a sequence's ratio is the geometric mean of its tokens', within about 1e-3 of "
        "1, so the paper clips it at 1 - 0.0003 (0.2 would almost never bind)",
    ]
    assert lines["eps_clip_high"].split(None, 2)[1:] == [
        "0.0004",
        rule + "the paper's upper clip, 1 + 0.0004",
    ]
    # the async profile's clip-higher (0.28) is kept, with a warning: it cannot bind here
    (tmp_path / "p.yaml").write_text(
        "name: p\nprofile: max-throughput\nstages:\n  rl:\n    kind: rl\n"
        "    config: {input: d.jsonl, ratio_level: sequence}\n"
    )
    out = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert out.exit_code == 0, out.stderr
    warned = [w for w in out.stderr.splitlines() if "(GSPO) clips one ratio" in w]
    assert len(warned) == 1 and warned[0].split(": ", 1)[1] == (
        "warning: stages.rl.config.eps_clip_high: ratio_level sequence (GSPO) clips one ratio "
        "per sequence, the geometric mean of its tokens', which seldom leaves 1 by more than "
        "1e-3: eps_clip_high 0.28 (profile max-throughput: async batches train a weight "
        "version after the one that sampled them, so the ratio leaves 1 and the clip binds: "
        "DAPO's clip-higher (0.28) lets low-probability tokens that scored well rise instead "
        "of being clipped at 1.2) almost never binds: GSPO's range is eps_clip 0.0003, "
        "eps_clip_high 0.0004 (ratio_level sequence's default; set it over a preset's)"
    )


@pytest.mark.parametrize(
    ("agg", "expected"),
    [("token_mean", 3.0), ("seq_mean_token_sum", 4.5), ("seq_mean_token_mean", 3.5)],
)
def test_loss_aggregations_as_verl_defines_them(agg: str, expected: float):
    """Per-token losses [1, 3] (a 2-token answer) and [5]: token_mean 9/3; each
    sequence's sum averaged: (4 + 5)/2; each sequence's mean averaged: (2 + 5)/2."""
    losses = torch.tensor([1.0, 3.0, 5.0])
    zero = torch.zeros(3)  # ratio 1: the surrogate's loss is -advantage
    weights, divisor = token_scale(agg, [(2, 2), (1, 1)], sequences=2, tokens=3)
    scale = None if weights is None else torch.tensor(weights)
    loss, _, _ = masked_policy_terms(zero, zero, -losses, torch.ones(3), 0.2, scale=scale)
    assert loss.item() / divisor == pytest.approx(expected)


def test_a_sequences_mean_counts_its_loss_tokens_only():
    """seq_mean_token_mean on an episode of 3 tokens of which 2 are the model's: its mean
    is over those 2."""
    weights, divisor = token_scale("seq_mean_token_mean", [(3, 2)], sequences=1, tokens=2)
    zero = torch.zeros(3)
    mask = torch.tensor([1.0, 0.0, 1.0])
    loss, _, _ = masked_policy_terms(
        zero, zero, -torch.tensor([2.0, 100.0, 4.0]), mask, 0.2, scale=torch.tensor(weights)
    )
    assert loss.item() / divisor == pytest.approx(3.0)


# --- dynamic sampling on a real engine -------------------------------------------------

ROWS = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(4) for b in range(3)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from stages.rl.rollout.local import LocalEngine

    folder = tmp_path_factory.mktemp("m")
    texts = [f"{r['prompt']} {r['answer']}" for r in ROWS] * 5
    build_tiny_model(
        TinyModel(hidden_size=32, num_layers=1, num_heads=2, vocab_size=300),
        texts,
        str(folder),
        seed=0,
    )
    torch.manual_seed(0)
    return LocalEngine(str(folder))


def controller(engine: Any, verifier: Verifier, **cfg: Any) -> Any:
    config = RLConfig(
        input="x.jsonl",
        verifier=verifier,
        **({"num_repeats": 4, "rollout_batch_size": 3, "max_output_tokens": 6} | cfg),
    )
    return SimpleNamespace(
        cfg=config,
        engine=engine,
        data=SimpleNamespace(rows=ROWS),
        stream=Stream(len(ROWS), config.rollout_batch_size, config.seed),
        make_env=environment_factory(None, config.verifier),
        version=1,
        reward=None,  # no reward model: the verifier scores
        ctx=SimpleNamespace(log=logging.getLogger("test")),
    )


CHANCE = Verifier(kind="regex", pattern="[0-9]")  # the untrained model is right by luck


def test_dynamic_sampling_trains_only_groups_with_a_signal_and_refills_within_its_bound(
    engine: Any,
):
    from stages.rl.controller.batch import rollout

    rounds = []
    for step in (1, 2, 3):
        plain = rollout(controller(engine, CHANCE, dynamic_sampling=False), step)
        c = controller(engine, CHANCE, dynamic_sampling=True, dynamic_sampling_max_rounds=3)
        batch = rollout(c, step)
        assert batch.indices[:3] == plain.indices  # the step's own prompts first
        assert len(set(batch.indices)) == len(batch.indices)  # refills are other prompts
        assert batch.rounds <= 3
        assert len(batch.indices) <= 3 * batch.rounds  # rollout_batch_size a round at most
        assert batch.kept <= 3
        assert batch.kept >= plain.kept  # it only adds groups
        groups: dict[tuple[int, ...], set[float]] = {}
        for s in batch.samples:
            groups.setdefault(s.ids[: s.prompt_len], set()).add(s.reward)
        assert len(groups) == batch.kept
        assert all(len(rewards) > 1 for rewards in groups.values())  # never a uniform group
        if batch.rounds < 3:
            assert batch.kept == 3  # it stopped because the step was full
        rounds.append(batch.rounds)
    assert 2 in rounds  # a refill happened and filled the step (this engine, these seeds)


def test_dynamic_sampling_stops_at_its_bound_when_no_group_has_a_signal(engine: Any):
    from stages.rl.controller.batch import rollout

    never = Verifier(kind="regex", pattern="^never$")
    c = controller(
        engine,
        never,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=3,
        advantage="reinforce_pp",
    )
    batch = rollout(c, 1)
    assert (batch.rounds, len(batch.indices), batch.kept, batch.samples) == (3, 9, 0, [])
    # without dynamic sampling REINFORCE++ trains every group (its advantages are not 0)
    every = rollout(controller(engine, never, advantage="reinforce_pp", dynamic_sampling=False), 1)
    assert every.kept == 3 and len(every.samples) == 12


def resolved_rl(tmp_path: Path, config: str) -> Any:
    """The rl stage of a one-stage pipeline with `config`, as `pipe plan` resolves it."""
    from engine.load.load import load_pipeline
    from engine.resolve.resolve import resolve

    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        f"name: p\nstages:\n  rl:\n    kind: rl\n    config: {{input: d.jsonl, {config}}}\n"
    )
    return resolve(load_pipeline(str(tmp_path / "p.yaml"), ()), run_dir=str(tmp_path)).stages["rl"]


def test_dynamic_sampling_is_off_by_default_for_every_estimator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: Any
):
    """Issue 45 point 13: at equal generated tokens and wall time dynamic sampling did not
    lead, so no estimator turns it on by default. A step trains on the groups it drew, no
    refill: REINFORCE++ trains every group (its baseline is the batch's), GRPO's family the
    groups whose rewards differ (a group whose rewards agree has advantages 0)."""
    from stages.rl.controller.batch import rollout

    monkeypatch.chdir(tmp_path)
    never = Verifier(kind="regex", pattern="^never$")  # every group's rewards agree
    trained = {"reinforce_pp": (3, 12, 1), "grpo": (0, 0, 1)}
    for advantage in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        stage = resolved_rl(tmp_path, f"advantage: {advantage}")
        assert stage.config.dynamic_sampling is False
        assert stage.source("dynamic_sampling").render() == "kind default"
        if advantage in trained:
            batch = rollout(controller(engine, never, **stage.config.model_dump(include={
                "advantage", "dynamic_sampling", "dynamic_sampling_max_rounds"})), 1)  # fmt: skip
            assert (batch.kept, len(batch.samples), batch.rounds) == trained[advantage]
    assert account_algorithm(stage.config)["dynamic_sampling"] == (
        "applied",
        "off: every group trains (REINFORCE++'s baseline is the batch's: a group whose rewards "
        "agree has advantages too)",
    )
    grpo = resolved_rl(tmp_path, "advantage: grpo")
    assert account_algorithm(grpo.config)["dynamic_sampling"] == (
        "applied",
        "off: groups whose rewards all agree have advantages 0 and train nothing; the step "
        "trains on the rest, no refill",
    )
    ppo = resolved_rl(tmp_path, "algorithm: ppo")
    assert ppo.config.dynamic_sampling is False
    assert ppo.source("dynamic_sampling").render() == "kind default"
    assert account_algorithm(ppo.config)["dynamic_sampling"] == (
        "applied",
        "off: every group trains (the critic values them)",
    )


def test_overlong_buffer_shapes_the_training_reward_not_the_recorded_one(engine: Any):
    from stages.rl.controller.batch import rollout

    everything = Verifier(kind="regex", pattern=".*")
    c = controller(
        Varied(engine), everything, overlong_buffer=4, max_output_tokens=6, dynamic_sampling=False
    )
    batch = rollout(c, 1)
    assert batch.kept == 3 and len(batch.samples) == 12
    assert all(r == 1.0 for group in batch.rewards for r in group)  # the verifier's verdicts
    for s in batch.samples:
        assert s.reward == pytest.approx(1.0 + overlong_penalty(s.completion_len, 6, 4, 1.0))
    assert batch.overlong is not None and batch.overlong < 0


class Varied:
    """The engine, a group's answers cut to 3, 4, 5 and 6 tokens (as if each had stopped
    there), so the overlong penalty differs within every group."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.tokenizer = inner, inner.tokenizer

    def generate(self, prompts: Any, **sampling: Any) -> list[list[Any]]:
        from dataclasses import replace

        return [
            [
                replace(g, token_ids=g.token_ids[: 3 + j], logprobs=g.logprobs[: 3 + j],
                        completion_tokens=min(g.completion_tokens, 3 + j))
                for j, g in enumerate(group)
            ]
            for group in self.inner.generate(prompts, **sampling)
        ]  # fmt: skip


def test_dynamic_sampling_judges_a_group_on_the_verifiers_rewards_not_the_shaped_ones(
    engine: Any,
):
    """Issue 45: with overlong_buffer, a group whose verifier rewards were all 1.0 was kept
    on its length-shaped rewards, pushing right answers down for their length. DAPO and verl
    (`filter_groups.metric: acc`) drop it: so does dynamic sampling here."""
    from stages.rl.controller.batch import rollout

    everything = Verifier(kind="regex", pattern=".*")  # every answer right
    shaped = {"overlong_buffer": 4, "max_output_tokens": 6}
    plain = rollout(controller(Varied(engine), everything, dynamic_sampling=False, **shaped), 1)
    assert plain.kept == 3  # without it they train on their shaped rewards (verl's default)
    c = controller(
        Varied(engine), everything, dynamic_sampling=True, dynamic_sampling_max_rounds=2, **shaped
    )
    batch = rollout(c, 1)
    assert all(r == 1.0 for group in batch.rewards for r in group)
    assert batch.overlong is not None and batch.overlong < 0  # their lengths differ
    assert (batch.kept, batch.samples, batch.rounds) == (0, [], 2)  # none trained, refilled
    how = account_algorithm(c.cfg)["dynamic_sampling"][1]
    assert how.startswith("groups whose verifier rewards all agree are dropped")
    assert how.endswith(
        "; judged on the verifier's rewards, not the overlong-shaped ones (as DAPO's and "
        "verl's filter_groups.metric acc)"
    )


# --- where a setting cannot act --------------------------------------------------------


def test_settings_that_cannot_act_are_recorded_skipped_with_a_reason():
    ppo = account_algorithm(RLConfig(input="x.jsonl", algorithm="ppo"))
    assert ppo["advantage"][0] == "skipped" and "GAE" in ppo["advantage"][1]
    assert ppo["dynamic_sampling"] == (
        "applied",
        "off: every group trains (the critic values them)",
    )
    ppo_on = account_algorithm(RLConfig(input="x.jsonl", algorithm="ppo", dynamic_sampling=True))
    assert ppo_on["dynamic_sampling"][0] == "skipped" and "critic" in ppo_on["dynamic_sampling"][1]
    grpo = account_algorithm(RLConfig(input="x.jsonl"))  # dynamic_sampling off by default
    assert grpo["dynamic_sampling_max_rounds"] == ("skipped", "dynamic_sampling is off")
    assert grpo["overlong_penalty"] == ("skipped", "overlong_buffer is empty")
    rloo = account_algorithm(RLConfig(input="x.jsonl", advantage="rloo"))
    assert rloo["std_normalize"][0] == "skipped"
    assert "seldom binds" in grpo["eps_clip_high"][1]  # one update per batch: ratio ~1
    several = account_algorithm(RLConfig(input="x.jsonl", ppo_epochs=2, eps_clip_high=0.28))
    assert several["eps_clip_high"] == (
        "applied",
        "the ratio kept at or below 1 + 0.28 (clip-higher)",
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            "algorithm: ppo, advantage: rloo",
            "p.yaml:5:57: stages.rl.config.advantage: algorithm ppo takes its advantages from "
            "the critic (GAE)",
        ),
        (
            "advantage: dr_grpo, loss_agg: seq_mean_token_mean",
            "p.yaml:5:60: stages.rl.config.loss_agg: Dr. GRPO (advantage dr_grpo) removes the "
            "per-sequence length normalisation",
        ),
        (
            "advantage: rloo, std_normalize: false",
            "p.yaml:5:62: stages.rl.config.std_normalize: acts with advantage grpo only; "
            "advantage rloo (p.yaml:5:41) divides by no std",
        ),
        ("dynamic_sampling: false, dynamic_sampling_max_rounds: 5", "dynamic_sampling is off"),
        (
            "advantage: reinforce_pp, dynamic_sampling_max_rounds: 5",
            "p.yaml:5:84: stages.rl.config.dynamic_sampling_max_rounds: dynamic_sampling is off "
            "(kind default): set it true, or leave this out",
        ),
        ("overlong_penalty: 0.5", "overlong_buffer is empty"),
        ("algorithm: ppo, dynamic_sampling: true", "algorithm ppo trains every group"),
        ("overlong_buffer: 8, max_output_tokens: 8", "must be shorter than max_output_tokens (8)"),
        (
            "overlong_buffer: 2, max_output_tokens: 8, environment: {kind: retry}",
            "a multi-turn episode's reward is the environment's",
        ),
        (
            "loss_agg: seq_mean",
            "expected 'token_mean', 'seq_mean_token_sum' or 'seq_mean_token_mean'",
        ),
    ],
)
def test_validate_refuses_a_setting_that_cannot_act(tmp_path: Path, config: str, message: str):
    from tests.conftest import run_cli

    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        f"name: p\nstages:\n  rl:\n    kind: rl\n    config: {{input: d.jsonl, {config}}}\n"
    )
    out = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert out.exit_code == 2, out.stdout
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("config", "warned"),
    [
        ("eps_clip_high: 0.28", True),
        ("ratio_level: sequence", True),
        ("eps_clip_high: 0.28, train_batch_size: 64", False),  # 4 updates a step
        ("eps_clip_high: 0.28, async_train: true", False),  # a version stale
    ],
)
def test_plan_warns_when_a_clip_set_by_the_user_can_only_bind_on_engine_noise(
    tmp_path: Path, config: str, warned: bool
):
    from tests.conftest import run_cli

    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        f"name: p\nstages:\n  rl:\n    kind: rl\n    config: {{input: d.jsonl, {config}}}\n"
    )
    out = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert out.exit_code == 0, out.stderr
    assert ("the ratio differs from 1 only by the engine's numeric" in out.stderr) is warned


def test_the_max_throughput_profile_turns_clip_higher_on_with_its_reason(tmp_path: Path):
    """Presets as data: the async profile sets eps_clip_high (async batches are a version
    stale, so the ratio leaves 1); no warning, as the clip can bind there."""
    from tests.conftest import run_cli

    (tmp_path / "d.jsonl").write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "p.yaml").write_text(
        "name: p\nprofile: max-throughput\nstages:\n  rl:\n    kind: rl\n"
        "    config: {input: d.jsonl}\n"
    )
    out = run_cli("plan", "p.yaml", "--explain", cwd=tmp_path)
    assert out.exit_code == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.strip().startswith("eps_clip_high"))
    assert "0.28  <- profile max-throughput: async batches train a weight version after" in line
    assert "the ratio differs from 1 only" not in out.stderr

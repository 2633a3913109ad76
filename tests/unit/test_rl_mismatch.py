"""Rollouts are the policy the loss trains (issue 38): the truncated importance weight and
loss by hand; the mismatch figure of the actor's `train` near 0 when the fp32 local engine
samples as the actor scores, and clearly above 0 when it samples at another temperature;
truncated importance sampling with no mismatch trains as without; a token a mask mode takes
out leaves the loss's denominator as well as its numerator (issue 56)."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, replace
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stages.lib.builders.recipe import TinyModel  # noqa: E402
from stages.lib.builders.tiny import build_tiny_model  # noqa: E402
from stages.lib.config import Verifier  # noqa: E402
from stages.rl import RLConfig  # noqa: E402
from stages.rl.algo.correction import correct  # noqa: E402
from stages.rl.algo.loss import masked_policy_terms  # noqa: E402
from stages.rl.algo.mismatch import Gap  # noqa: E402
from stages.rl.algo.options import Correction  # noqa: E402

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "vocab_size": 300}
ROWS = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(4) for b in range(3)]
CHANCE = Verifier(kind="regex", pattern="[0-4]")  # the untrained model's luck: some right
SETTINGS = {"num_repeats": 4, "rollout_batch_size": 12, "max_output_tokens": 6}


def test_tis_weight_and_loss_by_hand():
    """w = min(exp(pi_old - mu), cap); the clipped surrogate against pi_old, times w."""
    log = torch.log
    new = log(torch.tensor([0.5, 0.5, 0.2])).requires_grad_()
    pi_old = log(torch.tensor([0.5, 0.4, 0.2]))
    mu = log(torch.tensor([0.5, 0.1, 0.4]))
    w, keep, _ = correct(pi_old, mu, torch.ones(3), [3], Correction("token_truncate", 2.0, None))
    assert keep.tolist() == [1.0, 1.0, 1.0]
    assert w.tolist() == pytest.approx([1.0, 2.0, 0.5])  # 4.0 truncated to 2
    assert not w.requires_grad
    adv = torch.tensor([1.0, 1.0, -1.0])
    # ratios 1, 1.25 (clipped to 1.2 with A > 0), 1: per token -1, -1.2, +1; weighted
    loss, _, clipped = masked_policy_terms(new, pi_old, adv, torch.ones(3), 0.2, tis=w)
    assert loss.item() == pytest.approx(-1.0 * 1 - 1.2 * 2 + 1.0 * 0.5)
    assert clipped.item() == 1.0
    loss.backward()
    # d/d new of -w r A: token 0 -1, token 1 clipped (0), token 2 +0.5
    assert new.grad.tolist() == pytest.approx([-1.0, 0.0, 0.5])
    masked, _, _ = masked_policy_terms(new, pi_old, adv, torch.tensor([1.0, 0.0, 1.0]), 0.2, tis=w)
    assert masked.item() == pytest.approx(-0.5)
    plain, _, _ = masked_policy_terms(new, pi_old, adv, torch.ones(3), 0.2)
    assert plain.item() == pytest.approx(-1.0 - 1.2 + 1.0)  # no weights: as before


def test_gap_adds_up_the_masked_tokens():
    gap = Gap()
    gap.add(torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -2.0, -3.5]), torch.ones(3), [3])
    gap.add(torch.tensor([-1.0, -9.0]), torch.tensor([-1.25, -1.0]), torch.tensor([1.0, 0.0]), [2])
    figures = gap.figures()
    assert figures["logprob_diff_mean"] == pytest.approx(3.75 / 4)
    assert figures["logprob_diff_max"] == pytest.approx(3.0)
    assert Gap().figures() == {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("m")
    texts = [f"{r['prompt']} {r['answer']}" for r in ROWS] * 5
    build_tiny_model(TinyModel(**TINY), texts, str(folder), seed=0)
    return str(folder)


def rollout_samples(model_dir: str, temperature: float) -> list[Any]:
    """Step 1's kept samples from the fp32 local engine sampling at `temperature`."""
    from stages.lib.env.contract import environment_factory
    from stages.rl.controller.batch import rollout
    from stages.rl.rollout.local import LocalEngine
    from stages.rl.rollout.prompts import Stream

    torch.manual_seed(0)
    cfg = RLConfig(input="x.jsonl", verifier=CHANCE, temperature=temperature, **SETTINGS)
    c = SimpleNamespace(
        cfg=cfg,
        engine=LocalEngine(model_dir),
        data=SimpleNamespace(rows=ROWS),
        stream=Stream(len(ROWS), cfg.rollout_batch_size, cfg.seed),
        make_env=environment_factory(None, CHANCE),
        version=0,
        reward=None,  # no reward model: the verifier scores
        ctx=SimpleNamespace(log=logging.getLogger("test")),
    )
    samples = rollout(c, 1).samples
    assert samples, "no group with a signal"
    return samples


def actor(model_dir: str, **cfg: Any) -> Any:
    """The actor's request handlers on one CPU rank under plain torch (no process, no spec)."""
    from stages.lib.distributed.rank import load_model, make_trainer
    from stages.rl.roles.actor import Actor

    a = Actor.__new__(Actor)
    a.cfg = RLConfig(input="x.jsonl", micro_train_batch_size=2, train_batch_size=4, **cfg)
    a.rank, a.world, a.device = 0, 1, "cpu"
    torch.manual_seed(0)
    model = load_model(model_dir, None)
    a.pad_id = int(model.config.pad_token_id or model.config.eos_token_id or 0)
    a.trainer = make_trainer("torch", None, a.cfg, model, 10, "cpu")
    a.reference, a.pi_old = None, None
    return a


def train(a: Any, samples: list[Any]) -> dict[str, float]:
    return dict(a.train({"step": 1, "samples": [asdict(s) for s in samples]}))


def test_the_figure_is_near_zero_when_the_engine_samples_as_the_actor_scores(model_dir: str):
    stats = train(actor(model_dir), rollout_samples(model_dir, 1.0))
    assert stats["updates"] > 1  # the figure is the first step's
    assert 0.0 <= stats["logprob_diff_mean"] <= stats["logprob_diff_max"] < 1e-4
    # the figures the field logs, every step, with no correction on: no mismatch, none masked
    assert stats["mismatch_k3"] == pytest.approx(0.0, abs=1e-8)
    assert stats["mismatch_chi2_token"] == pytest.approx(0.0, abs=1e-5)
    assert stats["mismatch_chi2_seq"] == pytest.approx(0.0, abs=1e-4)
    assert stats["mismatch_ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert stats["mismatch_masked_token_frac"] == 0.0 == stats["mismatch_masked_seq_frac"]


def test_the_figure_is_clearly_above_zero_at_another_temperature(model_dir: str):
    """The engine samples at 0.5; the loss takes log-probabilities at 1.0 (measured: mean
    0.089, max 0.22 nats on this near-uniform tiny model, against 2e-8 and 5e-7 above)."""
    samples = rollout_samples(model_dir, 0.5)
    stats = train(actor(model_dir, temperature=1.0), samples)
    assert stats["logprob_diff_mean"] > 0.05
    assert stats["logprob_diff_max"] > 0.1
    assert "tis_weight_mean" not in stats
    with_tis = train(actor(model_dir, temperature=1.0, tis_cap=1.05), samples)
    # over every sample, from the no-grad pass: the first step's samples are among them
    assert with_tis["logprob_diff_mean"] > 0.05
    assert with_tis["logprob_diff_max"] >= stats["logprob_diff_max"]
    assert 0.0 < with_tis["tis_capped_frac"] < 1.0
    assert 0.0 < with_tis["tis_weight_mean"] <= 1.05
    # a mask mode on the same batch: the same figures (the same no-grad pass), some sequences
    # out of the loss, whole, and out of the tokens the step counts
    masked = train(actor(model_dir, temperature=1.0, tis_mode="sequence_mask"), samples)
    for name in ("mismatch_k3", "mismatch_chi2_token", "mismatch_chi2_seq", "logprob_diff_mean"):
        assert masked[name] == pytest.approx(with_tis[name]), name
    assert masked["mismatch_k3"] > 1e-3 and masked["mismatch_ppl_ratio"] != pytest.approx(1.0)
    total = sum(s.trained_len for s in samples)
    assert masked["tokens"] == round(total * (1 - masked["mismatch_masked_token_frac"]))
    assert 0.0 < masked["mismatch_masked_seq_frac"] <= 1.0
    assert not math.isnan(masked["loss"])


def test_tis_without_a_mismatch_trains_as_without(model_dir: str):
    """With the fp32 engine pi_old equals mu (to ~1e-7): every weight is 1, the ratio the
    same, so the update is the one without truncated importance sampling."""
    samples = rollout_samples(model_dir, 1.0)
    plain, tis = actor(model_dir), actor(model_dir, tis_cap=2.0, ppo_epochs=2)
    plain.cfg = plain.cfg.model_copy(update={"ppo_epochs": 2})
    a, b = train(plain, samples), train(tis, samples)
    assert b["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert b["tis_capped_frac"] == 0.0
    assert b["logprob_diff_max"] < 1e-4
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    for (name, p), q in zip(
        plain.trainer.module.named_parameters(), tis.trainer.module.parameters(), strict=True
    ):
        assert torch.allclose(p, q, atol=1e-5), name
    assert not math.isnan(a["loss"])


def test_tis_acts_in_async_mode_on_a_batch_sampled_a_version_behind(model_dir: str):
    """Issue 45: the docs said truncated importance sampling is not done in async mode,
    while `tis_cap` with `async_train` was accepted and ran. It is done: the actor has the
    engine's (behaviour) log-probabilities of a batch a version behind, and the ratio is
    taken against its own weights at the step's start; `settings.json` says so."""
    from stages.rl.controller.applied import account
    from stages.rl.sync.choice import SyncChoice

    samples = rollout_samples(model_dir, 1.0)  # sampled with the weights of version 0
    a = actor(model_dir, tis_cap=2.0, async_train=True, learning_rate=1e-2)
    first = train(a, samples)  # the actor's update to version 1
    assert first["logprob_diff_max"] < 1e-4  # the batch was the actor's own
    stale = train(a, samples)  # the next step trains a batch of version 0, as async does
    assert stale["logprob_diff_mean"] > 1e-3  # the staleness is in the figure
    assert stale["tis_weight_mean"] != pytest.approx(1.0, abs=1e-4)  # and in the weights
    assert 0.0 < stale["tis_weight_mean"] <= 2.0
    saved = ("float32", "auto: the input's")
    status, how = account(a.cfg, "torch", "cpu", 1, SyncChoice("gloo", None), saved=saved)[
        "tis_cap"
    ]
    assert status == "applied" and how.endswith(
        "; with async_train the engine sampled with weights up to async_queue_size versions "
        "behind the actor's, and the weight corrects that staleness too"
    )


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_a_masked_token_leaves_the_loss_and_its_denominator(model_dir: str, agg: str):
    """Issue 56, slime's fix: a token that token_mask takes out leaves the token counts that
    divide the loss, not only its numerator. The engine's log-probabilities are the actor's,
    but 3 nats off on some tokens (a ratio of e^3 or e^-3: outside [0.5, 2]; a whole sample
    among them); the step with token_mask is the step without a correction on the same
    samples with those tokens out of the loss mask by hand: the same gradient, the same loss,
    the same token count. With the masked tokens weighing 0 but still counted (the bug), the
    token_mean gradient is smaller by the kept share exactly."""
    from stages.rl.algo.logprobs import Sample, completion_logprobs

    lengths = [4, 5, 3, 6]
    base = [
        Sample(ids=tuple(range(10 + 7 * i, 13 + 7 * i + n)), prompt_len=3, advantage=adv)
        for i, (n, adv) in enumerate(zip(lengths, [1.0, -1.0, 0.5, -0.5], strict=True))
    ]
    a0 = actor(model_dir)
    with torch.no_grad():
        lp, _ = completion_logprobs(a0.trainer.module, base, "cpu", 1.0, a0.pad_id, call=a0.trainer)
    actual = [x.tolist() for x in lp]
    out = {0: {1}, 1: {0, 3}, 3: set(range(6))}  # sample 3 out whole

    def engine(i: int, t: int) -> float:
        off = (3.0 if (i + t) % 2 else -3.0) if t in out.get(i, ()) else 0.0
        return actual[i][t] + off

    def by_hand(i: int, s: Any, **fields: Any) -> Any:
        return replace(s, old_logprobs=tuple(actual[i]), **fields)

    corrected = [
        replace(s, old_logprobs=tuple(engine(i, t) for t in range(n)))
        for i, (s, n) in enumerate(zip(base, lengths, strict=True))
    ]
    masks = [tuple(int(t not in out.get(i, ())) for t in range(n)) for i, n in enumerate(lengths)]
    hand = [by_hand(i, s, mask=masks[i]) for i, s in enumerate(base)]
    kept, total = sum(map(sum, masks)), sum(lengths)
    a = train(actor(model_dir, tis_mode="token_mask", loss_agg=agg), corrected)
    b = train(actor(model_dir, loss_agg=agg), hand)
    assert a["updates"] == b["updates"] == 1
    assert a["tokens"] == b["tokens"] == kept
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["mismatch_masked_token_frac"] == pytest.approx((total - kept) / total)
    assert a["mismatch_masked_seq_frac"] == pytest.approx(3 / 4)
    assert a["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)  # the kept tokens: r = 1
    # the bug: the masked tokens' loss 0 (their advantage 0), their count still dividing
    zero = [
        by_hand(i, s, advantages=tuple(0.0 if m == 0 else s.advantage for m in masks[i]))
        for i, s in enumerate(base)
    ]
    c = train(actor(model_dir, loss_agg=agg), zero)
    if agg == "token_mean":
        assert c["grad_norm"] == pytest.approx(a["grad_norm"] * kept / total, rel=1e-5)
    else:  # each sequence's mean over all its tokens, the whole-masked sequence counted
        assert c["grad_norm"] != pytest.approx(a["grad_norm"], rel=1e-3)

"""The GRPO objective: group advantages, the clipped loss, token normalisation, k3 KL."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from stages.lib.model.logits import token_logprobs  # noqa: E402
from stages.rl.algo.loss import (  # noqa: E402
    clipped_policy_loss,
    group_advantages,
    kl_k3,
)


def test_advantages_are_normalised_within_each_group_and_uniform_groups_dropped():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv, keep = group_advantages(rewards, std_normalize=True)
    assert keep.tolist() == [True, False, True]
    # [1, 0, 0, 1]: deviations +-0.5, squares 1 over n - 1 = 3: std 1/sqrt(3), so +-sqrt(3)/2
    half = 3**0.5 / 2
    assert adv[0].tolist() == pytest.approx([half, -half, -half, half], abs=1e-5)
    assert adv[2].sum().item() == pytest.approx(0.0, abs=1e-6)
    raw, _ = group_advantages(rewards, std_normalize=False)  # Dr. GRPO: no std division
    assert raw[2].tolist() == pytest.approx([-0.25, -0.25, -0.25, 0.75])


def _policy(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A linear policy over 5 tokens, 6 sampled answers of 3 tokens (2 groups of 3)."""
    gen = torch.Generator().manual_seed(seed)
    policy = torch.nn.Linear(4, 5)
    with torch.no_grad():
        policy.weight.copy_(torch.randn(5, 4, generator=gen))
    states = torch.randn(6, 3, 4, generator=gen)
    actions = torch.randint(0, 5, (6, 3), generator=gen)
    return policy, states, actions


def test_one_update_per_batch_is_reinforce_with_a_group_mean_baseline():
    policy, states, actions = _policy()
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    adv, _ = group_advantages(rewards, std_normalize=False)
    per_token = adv.reshape(6, 1).expand(6, 3)
    new = token_logprobs(policy(states), actions, temperature=1.0)
    loss, _ = clipped_policy_loss(new, new.detach(), per_token, eps_clip=0.2)
    (loss.sum() / new.numel()).backward()
    grpo = policy.weight.grad.clone()
    policy.zero_grad()
    new = token_logprobs(policy(states), actions, temperature=1.0)
    baseline = rewards.mean(dim=1, keepdim=True)
    reinforce = -((rewards - baseline).reshape(6, 1) * new).sum() / new.numel()
    reinforce.backward()
    assert torch.allclose(grpo, policy.weight.grad, atol=1e-6)


def test_micro_batches_give_the_full_batch_gradient():
    policy, states, actions = _policy(1)
    adv = torch.randn(6, 1).expand(6, 3)
    with torch.no_grad():
        old = token_logprobs(policy(states), actions, 1.0) + 0.05 * torch.randn(6, 3)
    n_tokens = actions.numel()

    def grad(micros: list[slice]) -> torch.Tensor:
        policy.zero_grad()
        for m in micros:
            new = token_logprobs(policy(states[m]), actions[m], 1.0)
            loss, _ = clipped_policy_loss(new, old[m], adv[m], 0.2)
            (loss.sum() / n_tokens).backward()  # the global batch's token count
        return policy.weight.grad.clone()

    full = grad([slice(0, 6)])
    assert torch.allclose(full, grad([slice(0, 2), slice(2, 5), slice(5, 6)]), atol=1e-6)


def test_the_clip_binds_outside_the_trust_region():
    new = torch.tensor([0.5, 0.0, -0.5])
    old = torch.zeros(3)
    loss, clipped = clipped_policy_loss(new, old, torch.ones(3), eps_clip=0.2)
    assert clipped.tolist() == [1.0, 0.0, 0.0]
    assert loss.tolist() == pytest.approx([-1.2, -1.0, -torch.exp(torch.tensor(-0.5)).item()])


def test_k3_is_zero_for_equal_policies_and_positive_otherwise():
    a = torch.tensor([-1.0, -2.0])
    assert kl_k3(a, a).tolist() == [0.0, 0.0]
    assert (kl_k3(a, a + 0.3) > 0).all()

"""The trained and frozen roles: actor, critic, reference, teacher, reward, each its ranks'
processes.

Input: the stage's slots and an `ActorBrief`. Output: each role's ranks started as one
torch.distributed job across its workers, and the channel the controller drives them by.

- `actor`, `critic`, `ref`, `teacher`, `reward`: one rank of each role
  (`python -m stages.rl.roles.ROLE BRIEF`); `rank_process`: the body every rank process runs
  around its role (set up, answer requests, gather a role's shares); `trained`: what the
  actor's and the critic's ranks share (the trainer, resuming, offload and reload).
- `policy_update`: the actor's update over a rollout batch; `proximal`: its side of the
  mismatch figure and of truncated importance sampling.
- `frozen`: the frozen reference policy and teacher: where each loads, how, what it scores
  (`teacher`: the ref role's rank on the teacher's folder).
- `reward`: the reward model's ranks (each scores its share of a batch's sequences) and the
  controller's side of them (`RewardRanks`).
- `brief`: what the stage hands every rank; `layout`: where the ranks of a role run and
  meet; `launch`: how a role's ranks are started on the workers; `channel`: the
  authenticated socket between the stage and a role's rank 0.

Imports the algorithms and weight sync's sending side; never the controller.
"""

"""One rank of the `teacher` role, run as its own process: `python -m stages.rl.roles.teacher
BRIEF.json`.

Input: the `ActorBrief` the ref role's ranks read, its `model_dir` the teacher's folder (the
stage compared its tokenizer with the policy's when it started) and the rank in the
environment; the teacher role's ranks form their own torch.distributed job on the role's
devices (`stages.rl.roles.frozen.in_actor` says when it has them). Output: answers to the
stage's requests: `teacher_logprobs` (each sample's completion log-probabilities under the
frozen teacher, in the compute dtype, as the reference's: `stages.rl.roles.ref`), `stop`.
"""

from __future__ import annotations

import logging
from typing import Any

from stages.lib.distributed.rank import exit_now
from stages.rl.roles.ref import RefRank

log = logging.getLogger("pipe.rl.teacher")


class TeacherRank(RefRank):
    """One rank of the `teacher` role: the frozen teacher, scoring its share of each batch."""

    WHAT = "teacher"


def handlers_of(rank: TeacherRank) -> dict[str, Any]:
    return {"teacher_logprobs": rank.ref_logprobs}


if __name__ == "__main__":
    from stages.rl.roles.rank_process import run_role

    exit_now(run_role(None, log, TeacherRank, handlers_of))

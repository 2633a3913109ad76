"""A single-turn verifiers 0.4.0 taskset (the tests' own, against verifiers' classes): add two
numbers; the reward is 1.0 when the last reply is the sum. Loaded by the bridge in
`.venv-verifiers` (tests/unit/test_verifiers_env.py)."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == task.answer)


class SumConfig(vf.TasksetConfig):
    n: int = 4


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.n):
            data = SumData(prompt=f"{i} + {i + 1} = ?", answer=str(2 * i + 1))
            yield SumTask(data, self.config.task)


__all__ = ["SumTaskset"]

"""A verifiers 0.4.0 taskset with one python tool (a Toolset's `@vf.tool` method) and a
`@vf.stop` predicate: the model may call `multiply` over several turns; the episode stops
after `max_calls` tool results, or when the model answers; reward 1.0 for the product."""

import verifiers.v1 as vf


class Calc(vf.Toolset):
    @vf.tool
    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers."""
        return str(a * b)


class ProductData(vf.TaskData):
    answer: str


class ProductConfig(vf.TaskConfig):
    max_calls: int = 3


class ProductTask(vf.Task[ProductData, vf.State, ProductConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calc(vf.ToolsetConfig())]

    @vf.stop
    async def too_many_calls(self, trace: vf.Trace) -> bool:
        return len(trace.tool_messages) >= self.config.max_calls

    @vf.reward
    async def correct(self, task: ProductData, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.metric
    async def calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class ProductTaskset(vf.Taskset[ProductTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(6, 7), (12, 12)]:
            yield ProductTask(ProductData(prompt=f"{a} * {b}?", answer=str(a * b)))


__all__ = ["ProductTaskset"]

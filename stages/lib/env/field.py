"""The `environment` block of the rl, collect and evaluate configs, and its plan-time rules.

Input: the YAML block (a built-in name or a `module:Class`, or a `url`). Output: an
`EnvironmentConfig`, and the located diagnostics of `check_environment` (an unimportable
module, a user's environment without `max_turns`, a verifier it would override). What an
environment is and does: `stages.lib.env.contract`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from engine.errors import Diagnostic
from engine.stage import ResolveContext
from stages.lib.block import Block, check_callable, named_or_callable

ENVIRONMENT_KINDS = ("single_turn", "retry", "calculator", "python")
# another ecosystem's environments, which run whole episodes against the stage's model served
# over HTTP and score them (`stages.lib.env.gym`: NeMo Gym's agent servers)
AGENT_KINDS = ("nemo_gym",)
_AGENT_FIELDS = ("config_paths", "agent", "head")
SERVED_KINDS = ("verifiers",)  # an ecosystem's environments, run in its own venv and served


def _environment_kind(value: Any) -> Any:
    kinds = (*ENVIRONMENT_KINDS, *AGENT_KINDS, *SERVED_KINDS)
    return named_or_callable(value, kinds, "module:Class")


class EnvironmentConfig(Block):
    """A multi-turn environment the model talks to (docs/rl/environments.md; the contract:
    `stages.lib.env.contract`)."""

    kind: Annotated[str | None, BeforeValidator(_environment_kind)] = Field(
        None,
        description="single_turn, retry, calculator, python (built-ins, scored by the stage's "
        "verifier; calculator and python offer that tool), nemo_gym (NeMo Gym's servers: "
        "config_paths and agent), verifiers (a verifiers taskset, 'env_id'; scores itself) or "
        "your own 'module:Class' (scores itself).",
    )
    env_id: str | None = Field(
        None,
        description="kind verifiers: the taskset, a module or installed package exporting "
        "one verifiers Taskset subclass (run in .venv-verifiers: make install-verifiers; "
        "docs/rl/verifiers.md).",
    )
    url: str | None = Field(
        None,
        description="An environment served over HTTP (POST /reset and /step, JSON); instead of "
        "kind.",
    )
    max_turns: int | None = Field(
        None,
        gt=0,
        description="Model turns per episode at most; required for 'module:Class', verifiers "
        "and url (built-ins: single_turn 1, retry 2, calculator 4, python 4).",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the environment (module:Class is built as "
        "Class(**config); kind verifiers: the taskset config's fields).",
    )
    timeout_s: float = Field(
        60.0, gt=0, description="A reset or step taking longer fails its episode."
    )
    max_failed_share: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Failed episodes (the environment raised, hung or answered nonsense) tolerated "
        "per step (rl) or per run (collect, evaluate); above it the stage fails.",
    )
    concurrency: int = Field(
        64, gt=0, description="Environment calls in flight at once (episodes wait on I/O together)."
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = Field(
        None,
        description="The format the model's tool calls are read in, in episodes with tools "
        "(hermes, llama3_json, mistral, pythonic; as vLLM's --tool-call-parser). Default: "
        "picked from the chat template; a server the stage starts parses with it too.",
    )

    config_paths: list[str] | None = Field(
        None,
        description="kind nemo_gym: the environment's NeMo Gym config files, as NeMo Gym's docs "
        "write them (relative to its package folder) or absolute; pipe adds the model server, "
        "pointed at the stage's backend, and starts the servers from .venv-gym/.",
    )
    agent: str | None = Field(
        None,
        description="kind nemo_gym: the agent server each row is sent to (its /run), as the "
        "configs name it.",
    )
    head: str | None = Field(
        None,
        description="kind nemo_gym: host:port of NeMo Gym's head server, for servers already "
        "running (instead of config_paths); their model server must point at the stage's "
        "backend.",
    )

    @property
    def agent_plays(self) -> bool:
        """Whether another ecosystem's agent plays each episode against the stage's model
        (`AGENT_KINDS`), rather than pipe driving the turns."""
        return self.kind in AGENT_KINDS

    @model_validator(mode="after")
    def _one_source(self) -> EnvironmentConfig:
        if (self.kind is None) == (self.url is None):
            raise ValueError("an environment needs exactly one of 'kind' or 'url'")
        return self


def scores_itself(env: EnvironmentConfig) -> bool:
    """Whether the environment scores its own episodes (a url, a `module:Class`, a served
    kind's), so the stage's verifier is not what rewards them."""
    return env.url is not None or (env.kind is not None and env.kind not in ENVIRONMENT_KINDS)


def check_environment(
    env: EnvironmentConfig | None, ctx: ResolveContext, path: str = "environment"
) -> list[Diagnostic]:
    """An environment must be loadable where the stage runs and bounded in turns; a user's
    environment scores its own episodes, so a verifier beside it (which it would override)
    is refused."""
    if env is None:
        return []
    out: list[Diagnostic] = []
    verifier_set = sorted(p for p in ctx.explicit if p == "verifier" or p.startswith("verifier."))
    user = scores_itself(env)
    out += _check_served(env, ctx, path)
    if env.kind in AGENT_KINDS:
        out += _check_agent(env, ctx, path)
    else:
        out += [
            ctx.error(
                f"{path}.{name}", f"'{name}' is for kind nemo_gym (this is {env.kind or 'a url'})"
            )
            for name in _AGENT_FIELDS
            if f"{path}.{name}" in ctx.explicit
        ]
    if env.kind is not None and env.kind not in SERVED_KINDS:
        out += check_callable(ctx, f"{path}.kind", "environment", env.kind, noun="class")
    if user and env.max_turns is None and env.kind not in AGENT_KINDS:
        out.append(
            ctx.error(
                f"{path}.kind" if env.kind else f"{path}.url",
                "an environment of your own (kind 'module:Class', verifiers or url) needs "
                "'max_turns': "
                "it decides when an episode is done, so the stage needs a bound",
            )
        )
    if user and verifier_set:  # a user's environment scores itself
        out.append(
            ctx.error(
                verifier_set[0],
                f"the environment ({ctx.source(f'{path}.kind' if env.kind else f'{path}.url')}) "
                "scores the episodes itself, so this "
                "verifier would be ignored: remove it (the built-in environments single_turn, "
                "retry, calculator and python are the ones scored by the verifier)",
            )
        )
    return out


def _check_agent(env: EnvironmentConfig, ctx: ResolveContext, path: str) -> list[Diagnostic]:
    """NeMo Gym's environment: an agent, and configs to start or a head to connect to; its
    agent bounds the turns, so `max_turns` would act on nothing."""
    out: list[Diagnostic] = []
    if env.agent is None:
        out.append(
            ctx.error(
                f"{path}.kind",
                "kind nemo_gym needs 'agent': the agent server "
                "each row is sent to, as its configs name it",
            )
        )
    if (env.config_paths is None) == (env.head is None):
        out.append(
            ctx.error(
                f"{path}.kind",
                "kind nemo_gym needs exactly one of "
                "'config_paths' (pipe starts NeMo Gym's servers) or 'head' (they "
                "run already: host:port of the head server)",
            )
        )
    if env.max_turns is not None:
        out.append(
            ctx.error(
                f"{path}.max_turns",
                "NeMo Gym's agent decides when an episode "
                "ends (its config's max_steps): remove max_turns, or set the agent's "
                "max_steps through 'config'",
            )
        )
    if env.head is not None and env.config:
        out.append(
            ctx.error(
                f"{path}.config",
                "'config' overrides the configs of servers pipe "
                "starts; with 'head' they run already: remove it",
            )
        )
    return out


def _check_served(env: EnvironmentConfig, ctx: ResolveContext, path: str) -> list[Diagnostic]:
    """`env_id` names the taskset of kind verifiers, and only there. Whether
    `.venv-verifiers` exists is the stage's to say when it starts the bridge (the machine
    that runs it may not be this one); verifiers is never imported here."""
    if env.kind == "verifiers" and not env.env_id:
        return [
            ctx.error(
                f"{path}.kind",
                "kind 'verifiers' needs 'env_id': the taskset to load (a module or an installed "
                "package exporting one verifiers Taskset subclass)",
            )
        ]
    if env.kind != "verifiers" and env.env_id is not None:
        return [ctx.error(f"{path}.env_id", "'env_id' is for kind 'verifiers' only")]
    return []


TOOL_ENVIRONMENTS = ("calculator", "python")  # the built-ins that offer a tool


def check_environment_tools(
    env: EnvironmentConfig | None,
    ctx: ResolveContext,
    chat_template: str | None,
    prompt_template: str | None,
    models: Sequence[tuple[str, Any]],
    served_elsewhere: str | None = None,
) -> list[Diagnostic]:
    """A built-in environment that offers a tool, in a stage that renders its prompts with a
    chat template known before the run (the `chat_template` setting, else the checkpoints'
    own), refused when that template cannot render tools (`check_tools_template`: the fix
    names a family template that can). A server that renders (`served_elsewhere`), or a
    checkpoint made by an earlier stage, is checked when it runs: its template is not known
    here."""
    import os

    from stages.lib.chat.template import checkpoint_template, template_text
    from stages.lib.chat.tool_template import check_tools_template

    if env is None or env.kind not in TOOL_ENVIRONMENTS or served_elsewhere is not None:
        return []
    if chat_template is not None:
        try:
            text = template_text(chat_template, prompt_template)
        except (ValueError, OSError):
            return []  # `check_chat_template` says what is wrong with the setting
        return check_tools_template(ctx, "chat_template", text, chat_template)
    out: list[Diagnostic] = []
    for path, value in models:
        if not isinstance(value, str) or ctx.is_produced(value) or not os.path.exists(value):
            continue
        try:
            own = checkpoint_template(value)
        except (OSError, ValueError):
            continue
        out += check_tools_template(ctx, path, own, os.path.basename(value.rstrip("/")))
    return out

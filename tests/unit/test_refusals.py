"""What `pipe plan` accepts, `pipe run` runs: every refusal on the run path, classified.

The test walks (with `ast`) every `raise` of an exception built with a message in
`stages/**/*.py` outside the plan side (each kind's config module
`stages/<kind>/__init__.py` and the shared rule modules `stages/lib/block.py`, `config.py`,
`build/recipe.py`, `model/declared.py`, `model/path.py`, `stages/lib/distributed/ds_config.py`,
`stages/lib/env/field.py`, whose errors are plan-time errors already) and outside
`stages/collect/tune/` (the `pipe tune` command, whose own refusals are located errors
before it measures anything). Each raise site must be in REFUSALS, keyed by its file and the
start of its message (an f-string's placeholders
read `{}`; a message with no literal text is the call's source), never by line, as one of:

- `plan`: the same condition is refused before anything starts. Its `Case` is a minimal
  pipeline (with `--set`s and a `--cluster`) that `pipe plan` and `pipe validate` both
  refuse, exit 2, printing the case's located lines exactly;
- `data` (the input files, or what earlier stages write), `environment` (what the machine
  has when the stage runs), `internal` (an invariant of this code: a bug if hit) or
  `transient` (network, timeouts): known only at run time, with a one-line reason.

A raise site not in the table fails with how to classify it; an entry whose site is gone
fails too. Bare re-raises (`raise`, `raise errors[0]`) carry an exception raised, and so
classified, where it was built; `assert`s are internal invariants by construction.
"""

from __future__ import annotations

import ast
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from tests.conftest import ROOT, run_cli, stub_checkpoint

Kind = Literal["plan", "data", "environment", "internal", "transient"]
PLAN_SIDE = (
    "stages/lib/block.py",
    "stages/lib/builders/recipe.py",
    "stages/lib/config.py",
    "stages/lib/backends/registered.py",
    "stages/lib/model/declared.py",
    "stages/lib/model/path.py",
    "stages/lib/distributed/ds_config.py",
    "stages/lib/env/field.py",
)
NOT_RUN_PATH = ("stages/collect/tune/",)


@dataclass(frozen=True)
class Case:
    """A minimal pipeline that `pipe plan` and `pipe validate` refuse with `lines`."""

    yaml: str
    lines: tuple[str, ...]
    sets: tuple[str, ...] = ()
    cluster: str | None = None
    files: tuple[tuple[str, str], ...] = ()  # (name, text) beside the pipeline, on the path


@dataclass(frozen=True)
class Refusal:
    kind: Kind
    why: str = ""
    case: Case | None = None


def plan(case: Case, why: str = "") -> Refusal:
    return Refusal("plan", why, case)


def data(why: str) -> Refusal:
    return Refusal("data", why)


def environment(why: str) -> Refusal:
    return Refusal("environment", why)


def internal(why: str) -> Refusal:
    return Refusal("internal", why)


def transient(why: str) -> Refusal:
    return Refusal("transient", why)


def no_input(kind: str, config: str) -> Case:
    return Case(
        f"name: p\nstages:\n  s: {{kind: {kind}, config: {config}}}\n",
        (
            "p.yaml:3:3: stages.s.config.input: no input: set 'input' or add the stage that "
            "produces it to 'needs'",
        ),
    )


VERIFIERS = Case(
    """\
    name: p
    stages:
      c: {kind: collect, config: {input: x.jsonl, backend: {kind: local, model: m}, verifier: {kind: "nomod:fn"}}}
      e: {kind: evaluate, config: {input: x.jsonl, checkpoints: [m], verifier: {kind: "no.mod:fn"}}}
      r: {kind: rl, config: {input: x.jsonl, verifier: {kind: "stages.lib.nomod:fn"}}}
      t: {kind: train, config: {input: x.jsonl, eval_input: y.jsonl, verifier: {kind: "json.nomod:fn"}}}
      u: {kind: collect, config: {input: x.jsonl, backend: {kind: local, model: m}, verifier: {kind: "json:nofn"}}}
    """,
    (
        "p.yaml:3:98: stages.c.config.verifier.kind: verifier 'nomod:fn': no module named 'nomod'",
        "p.yaml:4:83: stages.e.config.verifier.kind: verifier 'no.mod:fn': no module named 'no'",
        "p.yaml:5:59: stages.r.config.verifier.kind: verifier 'stages.lib.nomod:fn': no module "
        "named 'stages.lib.nomod'",
        "p.yaml:6:83: stages.t.config.verifier.kind: verifier 'json.nomod:fn': no module named "
        "'json.nomod'",
        "p.yaml:7:98: stages.u.config.verifier.kind: verifier 'json:nofn': module 'json' has no "
        "function 'nofn'",
    ),
)
# the vLLM role's 6 GPUs (3:1 of 8) do not split into engines of tensor-parallel size 4
VLLM_SLICES = Case(
    """\
    name: p
    cluster: {gpus: 8, gpus_per_node: 8}
    resources: {ratio: {vllm: 3, actor: 1}}
    stages:
      rl: {kind: rl, config: {input: x.jsonl, backend: {kind: vllm, vllm_tensor_parallel_size: 4}}}
    """,
    (
        "p.yaml:5:3: stages.rl.config.backend.vllm_num_engines: 1 engines x tensor-parallel "
        "size 4 = 4 GPUs, but role 'vllm' has 6",
    ),
    cluster="1x8x80GB",
)
VLLM_ENGINES = Case(
    """\
    name: p
    cluster: {gpus: 8, gpus_per_node: 8}
    stages:
      c: {kind: collect, resources: {gpus: 2}, config: {input: x.jsonl, backend: {kind: vllm, model: m}}}
    """,
    (
        "--set stages.c.config.backend.vllm_num_engines=4: "
        "stages.c.config.backend.vllm_num_engines: "
        "4 engines x tensor-parallel size 1 = 4 GPUs, but the stage has 2; use vllm_num_engines 2",
    ),
    sets=("stages.c.config.backend.vllm_num_engines=4",),
    cluster="1x8x80GB",
)
TINY = "name: p\nstages:\n  t: {{kind: train, config: {{input: x.jsonl, {config}}}}}\n"

# a model's tool call that does not parse: `parse_tool_calls` catches each (`CallError`) and
# returns it as the turn's error, never raised further
MODEL_CALLS = (
    ("stages/lib/chat/pythonic.py", "'{}' is not a literal value"),
    ("stages/lib/chat/pythonic.py", "'{}' is not a call of a function by name"),
    ("stages/lib/chat/pythonic.py", "call '{}': arguments must be given by na"),
    ("stages/lib/chat/pythonic.py", "call '{}': {}"),
    ("stages/lib/chat/pythonic.py", "a tool_code block that does not parse as"),
    ("stages/lib/chat/pythonic.py", "a tool_code block may hold calls only: {"),
    ("stages/lib/chat/pythonic.py", "a call list that does not parse as Pytho"),
    ("stages/lib/chat/tool_calls.py", "a call must be a JSON object, found {}"),
    ("stages/lib/chat/tool_calls.py", "a call has no function name: {}"),
    ("stages/lib/chat/tool_calls.py", "call '{}': arguments are not JSON ({}): "),
    ("stages/lib/chat/tool_calls.py", "call '{}': arguments must be an object, "),
    ("stages/lib/chat/tool_calls.py", "{} is not valid JSON ({}): {}"),
    ("stages/lib/chat/tool_calls.py", "a <tool_call> block holds more than one "),
    ("stages/lib/chat/tool_calls.py", "[TOOL_CALLS] must be followed by a list "),
    ("stages/lib/chat/tool_calls.py", "[TOOL_CALLS] is followed by neither a li"),
)

REFUSALS: dict[tuple[str, str], Refusal] = {
    # --- collect ---------------------------------------------------------------------------
    ("stages/collect/inputs.py", "a message's 'content' must be"): data("a malformed prompt row"),
    ("stages/collect/inputs.py", "'messages' must be a non-empty"): data("a malformed prompt row"),
    ("stages/collect/inputs.py", "each message needs a 'role'"): data("a malformed prompt row"),
    ("stages/collect/inputs.py", "'prompt' must be a string"): data("a malformed prompt row"),
    ("stages/collect/inputs.py", "the row has none of"): data("a prompt row without a prompt"),
    ("stages/collect/measure.py", "measure_level needs parallelism"): internal(
        "pipe tune calls it with levels >= 1 and a non-empty sample of prompts"
    ),
    ("stages/collect/measure.py", "row {}: {}"): data("a malformed prompt row in tune's sample"),
    ("stages/collect/ranged.py", "collect: 'input' is empty"): plan(
        no_input("collect", "{backend: {kind: local, model: m}}")
    ),
    ("stages/collect/ranged.py", "collect: input '{}' does not exist"): data(
        "an input file is written by an upstream stage or put in place before the run; plan "
        "reads no input file (it may live on storage only the workers see)"
    ),
    # --- dataset ---------------------------------------------------------------------------
    ("stages/dataset/run.py", "source 'reasoning_gym' needs a 'task'"): plan(
        Case(
            "name: p\nstages:\n  d: {kind: dataset}\n",
            (
                "p.yaml:3:3: stages.d.config.task: source 'reasoning_gym' needs a 'task', e.g. "
                "chain_sum",
            ),
        )
    ),
    ("stages/dataset/run.py", "source '{}' needs a 'path'"): plan(
        Case(
            "name: p\nstages:\n  d: {kind: dataset, config: {source: parquet}}\n",
            ("p.yaml:3:3: stages.d.config.path: source 'parquet' needs a 'path'",),
        )
    ),
    ("stages/dataset/run.py", "the source has only {} distinct prompts"): data(
        "the number of distinct prompts in the source file"
    ),
    ("stages/dataset/run.py", "found only {} distinct test prompts"): data(
        "how many distinct problems a reasoning-gym task has is known only by drawing them"
    ),
    ("stages/dataset/run.py", "{}: no prompt field"): data("a source row without a prompt field"),
    ("stages/dataset/run.py", "{} {}"): data(
        "a pairs source row without chosen/rejected (a jsonl file that exists is refused at "
        "plan time: test_reward_model)"
    ),
    ("stages/dataset/run.py", "source 'huggingface' needs the 'datasets'"): environment(
        "the datasets package on the worker"
    ),
    ("stages/dataset/run.py", "could not load Hugging Face dataset"): transient(
        "the hub unreachable, or the dataset id or split unknown there (known only by asking it)"
    ),
    ("stages/dataset/run.py", "source 'parquet' needs pyarrow"): environment(
        "pyarrow (or pandas) on the worker"
    ),
    # --- evaluate --------------------------------------------------------------------------
    ("stages/evaluate/run.py", "evaluate needs an 'input' prompt file"): plan(
        no_input("evaluate", "{checkpoints: [m]}")
    ),
    ("stages/evaluate/run.py", "evaluate needs at least one checkpoint"): plan(
        Case(
            "name: p\nstages:\n  e: {kind: evaluate, config: {input: x.jsonl}}\n",
            (
                "p.yaml:3:3: stages.e.config.checkpoints: no checkpoint to evaluate: list them in "
                "'checkpoints' or add the stage that trains one to 'needs'",
            ),
        )
    ),
    ("stages/evaluate/scores.py", "need 0 < k <= n"): internal("k_values(n) gives 0 < k <= n"),
    # --- filter ----------------------------------------------------------------------------
    ("stages/filter/parallel.py", "OutOfOrder(start"): data(
        "the input's rows of a prompt are not contiguous: caught, the file is sorted and filtered "
        "again"
    ),
    ("stages/filter/scan.py", "OutOfOrder(row.offset"): data(
        "the input's rows of a prompt are not contiguous: caught, the file is sorted and filtered "
        "again"
    ),
    ("stages/filter/rows.py", "{}: expected an integer"): data("a malformed rollout row"),
    ("stages/filter/rows.py", "{}: expected a JSON object"): data("a malformed rollout row"),
    ("stages/filter/rows.py", "{}: expected a numeric 'reward'"): data("a malformed rollout row"),
    ("stages/filter/rows.py", "{}: not a JSON line"): data("a malformed rollout row"),
    ("stages/filter/rescore.py", "{}:{}: the filter's verifier re-scores o"): data(
        "an episode row given to filter's verifier: only the rows decide it"
    ),
    ("stages/filter/pairs.py", "byte {}: an episode with no assistant tu"): data(
        "an episode row that cannot be paired"
    ),
    ("stages/filter/pairs.py", "byte {}: no string 'completion' to pair"): data(
        "a rollout row that cannot be paired"
    ),
    ("stages/filter/rules.py", "predicate '{}': cannot import"): plan(
        Case(
            'name: p\nstages:\n  f: {kind: filter, config: {input: x.jsonl, predicate: "nomod:keep"}}\n',
            (
                "p.yaml:3:57: stages.f.config.predicate: predicate 'nomod:keep': no module named "
                "'nomod'",
            ),
        ),
        "a module that is found but fails while importing is known only by running it",
    ),
    ("stages/filter/rules.py", "predicate '{}': '{}' has no function"): plan(
        Case(
            'name: p\nstages:\n  f: {kind: filter, config: {input: x.jsonl, predicate: "keepers:short"}}\n',
            (
                "p.yaml:3:57: stages.f.config.predicate: predicate 'keepers:short': module "
                "'keepers' has no function 'short'",
            ),
            files=(("keepers.py", "def keep(row):\n    return True\n"),),
        ),
        "a name bound to something that is not a function is known only by importing user code",
    ),
    ("stages/filter/run.py", "filter: no input"): plan(no_input("filter", "{}")),
    # --- shared by kinds -------------------------------------------------------------------
    ("stages/lib/backends/openai.py", "backend.api_key_env names"): environment(
        "the variable must be set where the stage runs; plan never reads secrets"
    ),
    ("stages/lib/backends/protocol.py", "backend kind '{}' has no HTTP endpoint"): internal(
        "callers open an endpoint only where the backend has no in-process generator"
    ),
    ("stages/lib/backends/vllm/backend.py", "expected a vllm backend, found '{}'"): internal(
        "called only on the rl path of a backend whose RL_ENGINE is its vLLM servers"
    ),
    ("stages/lib/api/client.py", "unreachable"): internal("the retry loop returns or raises first"),
    ("stages/lib/api/client.py", "bad_response"): transient("the server answered garbage: retried"),
    ("stages/lib/api/client.py", "the completions endpoint needs rows"): data(
        "a prompt row with messages sent to endpoint: completions"
    ),
    ("stages/lib/api/client.py", "status_error(resp.status"): transient(
        "an HTTP error status from the server: retried when retryable"
    ),
    ("stages/lib/io/audit.py", "{} mask values for {} completion ids"): internal(
        "a sample's loss mask has one value per completion token by construction"
    ),
    ("stages/lib/io/jsonl.py", "{}:{}: expected a JSON object"): data("a malformed JSONL line"),
    ("stages/lib/io/jsonl.py", "{}:{}: not valid JSON"): data("a malformed JSONL line"),
    ("stages/lib/distributed/spawn.py", "ranks {}-{} stopped"): environment(
        "a rank process of this job failed; its log says why"
    ),
    ("stages/lib/distributed/spawn.py", "training rank {} {}; last lines"): environment(
        "a rank process exited non-zero (out of memory, a signal, its own error in its log)"
    ),
    ("stages/lib/builders/bpe.py", "vocab_size must be at least"): plan(
        Case(
            TINY.format(config="model: {vocab_size: 100}"),
            (
                "p.yaml:3:65: stages.t.config.model.vocab_size: expected a number at least 262, "
                "found 100",
            ),
        )
    ),
    ("stages/lib/builders/tiny.py", "num_heads ({}) must divide"): plan(
        Case(
            TINY.format(config="model: {num_heads: 3}"),
            ("p.yaml:3:52: stages.t.config.model: num_heads 3 must divide hidden_size 128",),
        )
    ),
    ("stages/lib/builders/spm.py", "{}: not a SentencePiece BPE model"): environment(
        "the installed package's vocabulary file is not the release's (a broken install)"
    ),
    ("stages/lib/builders/spm.py", "the GGUF header ends early"): environment(
        "the installed GGUF part is cut short (a broken install)"
    ),
    ("stages/lib/builders/spm.py", "{}: not a GGUF file"): environment(
        "the installed package's vocabulary file is not the release's (a broken install)"
    ),
    ("stages/lib/builders/spm.py", "{}: an unknown GGUF version"): environment(
        "the installed package's vocabulary file is not the release's (a broken install)"
    ),
    ("stages/lib/builders/spm.py", "{}: not a SentencePiece vocabulary"): environment(
        "the installed package's vocabulary file is not the release's (a broken install)"
    ),
    ("stages/lib/builders/conventions.py", "vocab 'real' for family '{}' reads {} fr"): environment(
        "the package shipping the vocabulary is installed, or not, where the stage runs"
    ),
    ("stages/lib/builders/families.py", "unknown family '{}'; expected one of {}"): plan(
        Case(
            TINY.format(config="model: {family: qwen}"),
            (
                "p.yaml:3:61: stages.t.config.model.family: expected 'chatml', 'llama3', "
                "'gemma' or 'mistral', found 'qwen'",
            ),
        )
    ),
    ("stages/lib/builders/families.py", "unknown dtype '{}'; expected one of {}"): plan(
        Case(
            TINY.format(config="model: {family: chatml, dtype: bf16}"),
            (
                "p.yaml:3:76: stages.t.config.model.dtype: expected 'bfloat16', 'float32' or "
                "'float16', found 'bf16'; did you mean 'bfloat16'?",
            ),
        )
    ),
    ("stages/lib/chat/template.py", "chat_template plain needs a prompt_templ"): plan(
        Case(
            TINY.format(config="chat_template: plain"),
            (
                "p.yaml:3:60: stages.t.config.chat_template: chat_template plain needs a "
                'prompt_template, such as "Question: {prompt}\\nAnswer:"',
            ),
        )
    ),
    ("stages/lib/distributed/schedule.py", "unknown lr_scheduler"): plan(
        Case(
            TINY.format(config="lr_scheduler: step"),
            (
                "p.yaml:3:59: stages.t.config.lr_scheduler: expected 'constant', 'cosine' or "
                "'linear', found 'step'",
            ),
        )
    ),
    ("stages/lib/distributed/seqpar.py", "world size {} is not divisible by ring_a"): plan(
        Case(
            TINY.format(
                config="packing_samples: false, num_processes: 3, ring_attn_size: 2, "
                "train_batch_size: 24"
            ),
            (
                "p.yaml:3:103: stages.t.config.ring_attn_size: 3 rank(s) do not split into "
                "sequence-parallel groups of 2: use a divisor of 3, or give the stage a multiple "
                "of 2 (num_processes)",
            ),
        )
    ),
    ("stages/lib/distributed/seqpar.py", "ring_attn_size {} must divide the model'"): plan(
        Case(
            TINY.format(config="packing_samples: false, num_processes: 8, ring_attn_size: 8"),
            (
                "p.yaml:3:103: stages.t.config.ring_attn_size: 8 does not divide the model's "
                "attention heads (4) and key/value heads (4): each rank attends with 1/8 of them",
            ),
        ),
        "plan reads the heads from a tiny-model spec or a config.json it can open; a model "
        "known only when the stage starts (an earlier stage's output) is checked by the ranks",
    ),
    ("stages/lib/distributed/seqpar.py", "ring_attn_size {}: the model's sliding-wi"): data(
        "a checkpoint's sliding window, read when the ranks load its config"
    ),
    ("stages/lib/distributed/seqpar.py", "ring_attn_size {} needs the model's atte"): data(
        "a checkpoint whose attention transformers does not run through 'sdpa' (eager, flex): "
        "known once the ranks load it"
    ),
    ("stages/lib/distributed/trainer.py", "checkpoint {}/{} does not fit the model: "): data(
        "a resumable checkpoint on disk whose weights are not this model's"
    ),
    (
        "stages/lib/model/lora/output.py",
        "adapter weights that fit no module of the base: {}",
    ): internal("the adapters were made on this base with the same settings"),
    ("stages/lib/model/lora/wrap.py", "lora.target_modules: {}"): data(
        "the model's modules, known when it loads: an earlier stage's output, a GGUF file or a "
        "model built from config (a checkpoint folder or cached hub model is refused at plan "
        "time from its .safetensors headers: tests/unit/test_lora_targets.py)"
    ),
    (
        "stages/lib/model/lora/__init__.py",
        "expected 'all-linear' or at least one module name, ",
    ): plan(
        Case(
            """\
            name: p
            stages:
              t: {kind: train, config: {input: x.jsonl, lora: {target_modules: []}}}
            """,
            (
                "p.yaml:3:68: stages.t.config.lora.target_modules: expected 'all-linear' or at "
                "least one module name, found []",
            ),
        )
    ),
    ("stages/lib/distributed/trainer.py", "deepspeed could not load the checkpoint"): data(
        "a checkpoint on disk that DeepSpeed cannot read"
    ),
    ("stages/evaluate/multiturn.py", "evaluate: {}: {}"): plan(
        Case(
            """\
            name: p
            stages:
              e: {kind: evaluate, config: {input: x.jsonl, environment: {kind: retry}, backend: {kind: openai, base_url: "http://h/v1", model: m, endpoint: completions}}}
            """,
            (
                "p.yaml:3:145: stages.e.config.backend.endpoint: an environment's episodes are "
                "conversations, sent to the chat endpoint: set it to 'chat', found 'completions'",
            ),
        )
    ),
    ("stages/rl/rollout/vllm_requests.py", "status_error(resp.status, text, resp.hea"): transient(
        "a vLLM server's HTTP error: retried while retryable, then the step fails naming it"
    ),
    ("stages/rl/rollout/vllm_requests.py", "{}: {}"): transient(
        "a sample request that failed for good (after its retries): the step fails naming the "
        "server"
    ),
    ("stages/rl/rollout/vllm_requests.py", "the loop breaks or raises on its last at"): internal(
        "the retry loop breaks or raises on its last attempt"
    ),
    ("stages/rl/rollout/vllm_requests.py", "an answer of {} token ids came with {} l"): environment(
        "a server that scores fewer tokens than it returns (not vLLM's V1 engine): the step "
        "fails naming it, rather than train tokens without their behaviour log-probability"
    ),
    # --- NeMo Gym's agents (stages.lib.env.gym, responses; stages.collect.agent_runs) ---
    ("stages/lib/env/responses.py", "the agent's answer is not a run result ("): transient(
        "the agent answered JSON that is not a run result: retried, then the failures sidecar"
    ),
    ("stages/lib/env/responses.py", "a NeMo Gym row needs 'responses_create_p"): data(
        "an input row NeMo Gym cannot run: a bad row in the failures sidecar"
    ),
    ("stages/lib/env/gym.py", "environment kind nemo_gym: NeMo Gym is n"): environment(
        "NeMo Gym is installed where the stage runs (make install-gym), or it is not"
    ),
    ("stages/lib/env/gym.py", "environment.config_paths: no NeMo Gym co"): environment(
        "the configs are files of the NeMo Gym installed where the stage runs"
    ),
    ("stages/lib/env/gym.py", "environment.head: the NeMo Gym servers a"): environment(
        "servers already running, configured outside pipe: what their model server calls is "
        "known only by asking their head"
    ),
    ("stages/lib/env/gym.py", "environment.agent: the NeMo Gym head at "): environment(
        "servers already running: which agents they serve is known only by asking their head"
    ),
    ("stages/lib/env/gym.py", "environment.agent: NeMo Gym's servers st"): environment(
        "the agents the configs start are NeMo Gym's to name: known once its servers run"
    ),
    ("stages/lib/env/gym.py", "nemo_gym: ng_run exited with {} before i"): environment(
        "NeMo Gym's own start failed (its log's end is in the message)"
    ),
    ("stages/lib/env/gym.py", "nemo_gym: servers not ready after {} s; "): transient(
        "NeMo Gym's servers did not come up in time (its log's end is in the message)"
    ),
    # --- the policy endpoint (a request's refusal is its HTTP answer, never the stage's) ---
    ("stages/rl/controller/core.py", "NeMo Gym's agent plays this stage's epis"): internal(
        "the controller's environment factory is never called where the agent plays"
    ),
    ("stages/rl/rollout/agent_play.py", "top_p {}: the rl engine samples with top"): data(
        "a /run request (the row's agent) asking a top_p the rl engine does not sample with: "
        "the episode fails with the endpoint's 500"
    ),
    ("stages/lib/serve/policy.py", "This model's maximum context length is {"): data(
        "vLLM's own refusal of a prompt with no room left: NeMo Gym reads it as a turn cut for length"
    ),
    ("stages/lib/serve/policy.py", "BadRequest(str(e))"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/policy.py", "the chat template failed on these messag"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/policy.py", "the policy endpoint could not start on {"): environment(
        "the port was taken or the host cannot be bound"
    ),
    ("stages/lib/serve/wire.py", "expected 'messages' (a list of chat mess"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "tools[{}]: expected {'type': 'function',"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}.role: expected one of 'system', 'deve"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}: a tool message needs its 'tool_call_"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}: expected {'id': str, 'type': 'functi"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "chat_template_kwargs: the chat template "): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "expected a JSON object, found {}"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "messages: expected a non-empty list of m"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "tools: expected a list of function schem"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}.content: expected a string or a list "): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}.content[{}]: only text parts are serv"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}.function.arguments: expected a JSON s"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}.function.arguments: not a JSON object"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}.tool_calls: a list on an assistant me"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}: expected a number in [{}, {}], found"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}: expected an integer >= {}, found {}"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}: expected true or false, found {}"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    ("stages/lib/serve/wire.py", "{}: {} is not supported: {}"): data(
        "a client's request the policy endpoint refuses: answered 400 with the message, the server goes on"
    ),
    # --- environments (an episode's failure is counted; only the share ends a stage) -------
    ("stages/lib/env/contract.py", "{} took longer than {} s"): data(
        "a user's environment hanging: fails its episode, counted against max_failed_share"
    ),
    ("stages/lib/env/contract.py", "{} raised {}: {}"): data(
        "a user's environment raising: fails its episode, counted against max_failed_share"
    ),
    ("stages/lib/env/messages.py", "{} returned the tool call {}: expected {"): data(
        "an environment (a user's, or one over HTTP) or a model server answered messages or tools that are not OpenAI's: that episode fails, counted against max_failed_share"
    ),
    (
        "stages/lib/env/messages.py",
        "{} returned {}: expected {'role': str, 'content': str} messa",
    ): data(
        "an environment (a user's, or one over HTTP) or a model server answered messages or tools that are not OpenAI's: that episode fails, counted against max_failed_share"
    ),
    ("stages/lib/env/messages.py", "{} returned tool_calls {} on a {} message"): data(
        "an environment (a user's, or one over HTTP) or a model server answered messages or tools that are not OpenAI's: that episode fails, counted against max_failed_share"
    ),
    ("stages/lib/env/messages.py", "{} returned a tool message without a 'tool_call_id'"): data(
        "an environment (a user's, or one over HTTP) or a model server answered messages or tools that are not OpenAI's: that episode fails, counted against max_failed_share"
    ),
    ("stages/lib/env/messages.py", "{} returned {}: expected a list of messages"): data(
        "an environment (a user's, or one over HTTP) or a model server answered messages or tools that are not OpenAI's: that episode fails, counted against max_failed_share"
    ),
    ("stages/lib/env/messages.py", "{}: tools {} is not a list of function schemas"): data(
        "an environment (a user's, or one over HTTP) or a model server answered messages or tools that are not OpenAI's: that episode fails, counted against max_failed_share"
    ),
    ("stages/lib/env/messages.py", "{}: the tool {} is not a function schema"): data(
        "an environment (a user's, or one over HTTP) or a model server answered messages or tools that are not OpenAI's: that episode fails, counted against max_failed_share"
    ),
    ("stages/lib/env/contract.py", "step returned {}: expected (reward"): data(
        "what a user's environment returns is known only when it runs: fails its episode"
    ),
    ("stages/lib/env/contract.py", "step returned the reward {}: expected a "): data(
        "what a user's environment returns is known only when it runs: fails its episode"
    ),
    ("stages/lib/env/contract.py", "step returned done={}"): data(
        "what a user's environment returns is known only when it runs: fails its episode"
    ),
    ("stages/lib/env/contract.py", "reset returned no messages"): data(
        "what a user's environment returns is known only when it runs: fails its episode"
    ),
    ("stages/lib/env/contract.py", "environment: 'max_turns' is required"): plan(
        Case(
            """\
            name: p
            stages:
              r: {kind: rl, config: {input: x.jsonl, environment: {kind: "json:JSONDecoder"}}}
            """,
            (
                "p.yaml:3:62: stages.r.config.environment.kind: an environment of your own "
                "(kind 'module:Class', verifiers or url) needs 'max_turns': it decides when an "
                "episode is done, so the stage needs a bound",
            ),
        )
    ),
    ("stages/lib/env/contract.py", "environment '{}': cannot load it"): plan(
        Case(
            """\
            name: p
            stages:
              r: {kind: rl, config: {input: x.jsonl, environment: {kind: "nomod:Env", max_turns: 2}}}
              c: {kind: collect, config: {input: x.jsonl, backend: {kind: local, model: m}, environment: {kind: "my_env:MathEnv", max_turns: 2}}}
            """,
            (
                "p.yaml:3:62: stages.r.config.environment.kind: environment 'nomod:Env': no "
                "module named 'nomod'",
                "p.yaml:4:101: stages.c.config.environment.kind: environment 'my_env:MathEnv': "
                "module 'my_env' has no class 'MathEnv'",
            ),
            files=(("my_env.py", "class MathEnvironment:\n    pass\n"),),
        ),
        "a module that is found but fails while importing (or whose source cannot settle the "
        "class: a star import, a module __getattr__) is known only by importing user code",
    ),
    ("stages/lib/env/contract.py", "environment '{}': cannot build it with config"): environment(
        "whether Class(**config) accepts the options is known only by running user code"
    ),
    ("stages/lib/env/served.py", "environment kind 'verifiers' runs in verifi"): environment(
        "whether .venv-verifiers exists on the machine that runs the stage (make "
        "install-verifiers): the stage says so when it starts the bridge"
    ),
    ("stages/lib/env/served.py", "verifiers bridge for '{}' {}; its last lin"): environment(
        "the taskset loads only in verifiers' venv (an id it cannot import, a config its "
        "class refuses): the bridge's last lines say why"
    ),
    ("stages/lib/env/verifiers_bridge.py", "the task has no prompt and no system pro"): data(
        "a row the taskset's task makes no opening from: fails its episode (the bridge answers "
        "HTTP 500 with the reason)"
    ),
    ("stages/lib/env/contract.py", "{}: {} of {} episodes failed"): data(
        "more episodes failed than environment.max_failed_share allows: known as they run"
    ),
    ("stages/lib/env/builtin.py", "the row has neither 'messages' nor"): data(
        "a prompt row without a prompt: fails its episode"
    ),
    ("stages/lib/env/tools.py", "exponent too large"): data(
        "the calculator's answer to the model's expression (an observation, not an error)"
    ),
    ("stages/lib/env/tools.py", "unsupported: {}"): data(
        "the calculator's answer to the model's expression (an observation, not an error)"
    ),
    ("stages/lib/env/sandbox_child.py", "{} {}: {}"): environment(
        "the kernel refused a namespace call: caught in the sandbox's child, which falls back "
        "to the audit hook (Result.fallback names it)"
    ),
    ("stages/lib/env/sandbox_child.py", "sandbox: {} is not allowed"): data(
        "model-written code tried an escape: raised in its own process, its Result shows it"
    ),
    ("stages/lib/env/sandbox_child.py", "sandbox: reading {} is not allowed"): data(
        "model-written code tried an escape: raised in its own process, its Result shows it"
    ),
    ("stages/lib/env/sandbox_child.py", "sandbox: writing {} outside the folder"): data(
        "model-written code tried an escape: raised in its own process, its Result shows it"
    ),
    ("stages/lib/env/sandbox_child.py", "sandbox: {} outside the folder"): data(
        "model-written code tried an escape: raised in its own process, its Result shows it"
    ),
    ("stages/lib/env/builtin.py", "{}/{} answered HTTP {}: {}"): transient(
        "the environment's server: fails its episode, counted against max_failed_share"
    ),
    ("stages/lib/chat/turns.py", "it renders the conversation before the o"): data(
        "a template that renders earlier turns differently once an observation follows: fails "
        "its episode (rl, multi_turn_tokens extend), counted against max_failed_share"
    ),
    ("stages/lib/chat/prompt.py", "a prompt of token ids has no messages"): internal(
        "token prompts are built by the rl stage's episodes, which never ask for messages"
    ),
    ("stages/lib/verify.py", "the row has no field"): data("a prompt row without its answer field"),
    ("stages/lib/verify.py", "verifier '{}' is not callable"): environment(
        "whether the attribute is a function is known only by importing user code, which plan "
        "never does (it checks that the module is there)"
    ),
    ("stages/lib/verify.py", "the verifier returned"): data(
        "what the user's verifier returns is known only when it scores a row"
    ),
    ("stages/lib/verify.py", "verifier kind 'regex' needs a 'pattern'"): plan(
        Case(
            TINY.format(config="eval_input: y.jsonl, verifier: {kind: regex}"),
            ("p.yaml:3:76: stages.t.config.verifier: verifier kind 'regex' needs a 'pattern'",),
        )
    ),
    ("stages/lib/verify.py", "the row names no reasoning-gym task"): data(
        "a prompt row without its task"
    ),
    ("stages/lib/verify.py", "verifier '{}': cannot load it"): plan(
        VERIFIERS,
        "a module that is found but fails while importing (or whose source cannot settle the "
        "function: a star import, a module __getattr__) is known only by importing user code",
    ),
    ("stages/lib/backends/vllm/server.py", "vLLM is not installed"): environment(
        "vLLM on the worker"
    ),
    ("stages/lib/backends/vllm/server.py", "a vllm backend needs a 'model'"): plan(
        Case(
            "name: p\nstages:\n  c: {kind: collect, config: {input: x.jsonl, backend: {kind: "
            "vllm}}}\n",
            (
                "p.yaml:3:3: stages.c.config.backend: a 'vllm' backend needs a 'model' to "
                "generate with",
            ),
        ),
        "evaluate and rl fill the model in themselves",
    ),
    ("stages/lib/backends/vllm/server.py", "vllm_num_engines ({}) x"): plan(VLLM_ENGINES),
    ("stages/lib/backends/vllm/server.py", "{}='{}' is not an executable"): environment(
        "$PIPE_VLLM_PYTHON on the worker"
    ),
    ("stages/lib/backends/vllm/server.py", "{} GPUs do not split"): plan(
        VLLM_SLICES, "the placement gives the vllm role whole tensor-parallel groups per node"
    ),
    ("stages/lib/backends/vllm/process.py", "vLLM server on port {} exited"): environment(
        "the server failed to start; its log says why"
    ),
    ("stages/lib/backends/vllm/process.py", "vLLM server on port {} not healthy"): environment(
        "the server was not up within startup_timeout_s on this machine"
    ),
    ("stages/lib/backends/vllm/server.py", "a vLLM server needs a secret"): internal(
        "every caller makes the run's secret (new_secret) before starting a server"
    ),
    ("stages/lib/backends/vllm/auth.py", "{} is not set: refusing to serve"): internal(
        "the server's environment always carries the secret its starter made"
    ),
    # --- rl --------------------------------------------------------------------------------
    ("stages/rl/roles/channel.py", "{} failed '{}'"): environment(
        "a role's process reports its own failure (its log has the traceback)"
    ),
    ("stages/rl/roles/channel.py", "{} exited before connecting"): environment(
        "a role's process died while starting; its log says why"
    ),
    ("stages/rl/roles/channel.py", "{} did not connect in"): transient(
        "a role's process too slow to start"
    ),
    ("stages/rl/roles/channel.py", "{} is gone"): environment("a role's process died"),
    ("stages/rl/roles/channel.py", "{} exited during"): environment("a role's process died"),
    ("stages/rl/roles/channel.py", "{} did not answer"): transient(
        "a role's process too slow to answer"
    ),
    ("stages/rl/roles/channel.py", "{} closed the channel"): environment("a role's process died"),
    ("stages/rl/rollout/prompts.py", "{}: no prompt rows"): data("an empty prompt file"),
    ("stages/rl/rollout/prompts.py", "{}:{}: a row needs"): data("a prompt row without a prompt"),
    ("stages/rl/controller/records.py", "settings not accounted for"): internal(
        "stages.rl.controller.applied.account names every field"
    ),
    ("stages/rl/controller/core.py", "rl needs prompts"): plan(no_input("rl", "{}")),
    ("stages/rl/sync/transports.py", "step {}: engine '{}' scored"): environment(
        "an engine's probe after a weight sync; a transfer that silently failed shows here"
    ),
    ("stages/rl/sync/transports.py", "step {}: engine '{}' does not match"): environment(
        "an engine's probe after a weight sync; a transfer that silently failed shows here"
    ),
    ("stages/rl/sync/transports.py", "engine '{}': weights did not arrive"): environment(
        "the weight transfer failed or timed out"
    ),
    ("stages/rl/sync/transports.py", "engine '{}': no parameter '{}'"): internal(
        "actor and engine build the same model from one model directory"
    ),
    ("stages/rl/sync/vllm.py", "SyncFailed('; '.join(errors))"): environment(
        "a vLLM server failed its part of a weight sync (each failure names its engine)"
    ),
    ("stages/rl/sync/vllm.py", "the server stopped answering /health du"): environment(
        "a vLLM server's engine core died during a weight sync"
    ),
    ("stages/rl/sync/vllm.py", "could not join the weight-sync group of "): environment(
        "an engine cannot reach the rendezvous or actor rank 0 (network between nodes)"
    ),
    ("stages/lib/backends/vllm/worker_ext.py", "pipe_sync_receive before pipe_sync_join"): internal(
        "the controller joins every server before the first receive"
    ),
    (
        "stages/lib/distributed/weight_group.py",
        "weight sync: parameter '{}' where '{}' w",
    ): internal("the sender announces the parameters in the order it sends them"),
    ("stages/rl/rollout/vllm.py", "{}: HTTP {}"): environment("a vLLM server refused a request"),
    ("stages/rl/rollout/vllm.py", "{}: {}"): transient("a vLLM server could not be reached"),
    # --- train -----------------------------------------------------------------------------
    ("stages/train/batch_plan.py", "no training data"): data("an empty training set"),
    ("stages/train/data.py", "has neither 'messages'"): data("a malformed training row"),
    ("stages/train/data.py", "has no 'completion'"): data("a malformed training row"),
    ("stages/train/data.py", "has no 'answer'"): data("a malformed training row"),
    ("stages/lib/chat/tool_template.py", "the episodes offer tools, and the chat t"): data(
        "tools offered by a user's environment or by rows are known only at run time (the "
        "built-in tool environments are refused at validate: check_environment_tools)"
    ),
    ("stages/train/data.py", "has a message that is not OpenAI's"): data(
        "a malformed training row"
    ),
    ("stages/train/data.py", "has tools that are not OpenAI's"): data("a malformed training row"),
    ("stages/train/data.py", "row {} has no numeric 'reward'"): data("a malformed DPO row"),
    ("stages/train/data.py", "{}: row {} {}"): data("a malformed training row, named"),
    ("stages/train/data.py", "the tokenizer has no end-of-sequence"): data(
        "the checkpoint's tokenizer, read when the stage loads it"
    ),
    ("stages/train/data.py", "no DPO pairs"): data("no prompt's rollouts differ in reward"),
    ("stages/train/pairwise.py", "DataError(str(e))"): data(
        "a pair row, named (the plan checks a file that exists then)"
    ),
    ("stages/train/pairwise.py", "{}: row {} has no numeric '{}' (margin: "): data(
        "a pair row without its margin field"
    ),
    ("stages/train/pairwise.py", "{}: margin '{}' names a field of prefere"): data(
        "rollouts, not pair rows, where margin names a field"
    ),
    ("stages/train/pairwise.py", "{}: {}"): data("a malformed rollout row, named"),
    ("stages/train/pairwise.py", "{}: no pairs: no prompt has rollouts who"): data(
        "no prompt's rollouts differ in reward"
    ),
    ("stages/train/pairwise.py", "{} has no reward head ('score')"): data(
        "a model family whose sequence-classification head is not named 'score'"
    ),
    ("stages/lib/io/preference.py", "{}: row {} {}"): data(
        "a pair row, named (a file that exists is refused at plan time)"
    ),
    ("stages/lib/model/reward_model.py", "the tokenizer has no end-of-sequence tok"): data(
        "the checkpoint's tokenizer, read when the stage loads it"
    ),
    ("stages/lib/model/reward_model.py", "'{}' is no reward model: {}"): data(
        "an earlier stage's checkpoint that is no reward model (a folder that exists is "
        "refused at plan time)"
    ),
    ("stages/lib/model/reward_model.py", "reward statistics need two scores or mor"): internal(
        "every pair gives two scores, and reward_set keeps at least one pair"
    ),
    ("stages/rl/roles/reward.py", "reward_model '{}': {}"): data(
        "an earlier stage's or the hub's reward model without the statistics normalize_reward "
        "divides by (a folder that exists is refused at plan time)"
    ),
    ("stages/rl/controller/start.py", "teacher '{}': {}"): data(
        "a teacher whose tokenizer is known only when the stage starts: an earlier stage's "
        "output, a GGUF file, a hub id not in the cache, or a policy built from a tiny-model "
        "spec (two folders on disk are compared, and refused, at plan time)"
    ),
    ("stages/lib/distributed/trainer_choice.py", "trainer 'deepspeed' asked for"): environment(
        "deepspeed on the worker; plan may run where it is not installed"
    ),
    **{
        key: data("a model's tool call that does not parse: the turn's error")
        for key in MODEL_CALLS
    },
    ("stages/lib/chat/pythonic.py", "'{}' cannot be written as a Python name"): data(
        "a tool-use trace whose function or argument name is no Python name, written for Gemma"
    ),
    ("stages/lib/chat/tool_calls.py", "unknown tool-call parser '{}'; expected "): internal(
        "callers pass a name of TOOL_CALL_PARSERS: a configured one is checked at plan"
    ),
    ("stages/lib/chat/tool_template.py", "jinja2.TemplateError(message)"): data(
        "a chat template's own raise_exception: a conversation the template refuses"
    ),
}


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    message: str


def message(call: ast.Call, constants: dict[str, str]) -> str:
    """The message an exception is built with, f-string placeholders as `{}`; with no
    literal text at all, the call's source."""
    parts, literal = [], False
    for arg in call.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            parts.append(arg.value)
        elif isinstance(arg, ast.JoinedStr):
            parts.append(
                "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in arg.values)
            )
        elif isinstance(arg, ast.Name) and arg.id in constants:
            parts.append(constants[arg.id])
        else:
            parts.append("{}")
            continue
        literal = True
    return " ".join(parts) if literal else ast.unparse(call)


def run_path(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    kind_config = path.name == "__init__.py" and path.parent.parent == ROOT / "stages"
    return not kind_config and rel not in PLAN_SIDE and not rel.startswith(NOT_RUN_PATH)


def raise_sites() -> list[Site]:
    """Every `raise X(message, ...)` on the run path, in file and line order."""
    out = []
    for path in sorted((ROOT / "stages").rglob("*.py")):
        if not run_path(path):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = {
            target.id: node.value.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                out.append(Site(rel, node.lineno, message(node.exc, constants)))
    return sorted(out, key=lambda s: (s.path, s.line))


def entries_of(site: Site) -> list[tuple[str, str]]:
    return [k for k in REFUSALS if k[0] == site.path and site.message.startswith(k[1])]


def test_every_raise_on_the_run_path_is_classified() -> None:
    sites = raise_sites()
    assert len(sites) > 80  # the walk found the run path
    problems = []
    for site in sites:
        found = entries_of(site)
        if not found:
            problems.append(
                f"{site.path}:{site.line}: raise {site.message[:60]!r} is not classified: add "
                f"({site.path!r}, {site.message[:40]!r}) to REFUSALS in "
                "tests/unit/test_refusals.py "
                "as plan(Case(...)) when the config and cluster alone decide it (with the "
                "plan-time check in the kind's config module), else as data, environment, "
                "internal or transient with a one-line reason"
            )
        elif len(found) > 1:
            problems.append(f"{site.path}:{site.line}: matched by several entries: {found}")
    assert not problems, "\n".join(problems)


def test_every_entry_names_a_raise_that_exists() -> None:
    sites = raise_sites()
    stale = [k for k in REFUSALS if not any(k in entries_of(s) for s in sites)]
    assert not stale, f"no raise on the run path has these messages any more: drop {stale}"


def test_every_entry_says_why_or_how_plan_refuses_it() -> None:
    for key, refusal in REFUSALS.items():
        if refusal.kind == "plan":
            assert refusal.case is not None, key
        else:
            assert refusal.why and "\n" not in refusal.why and refusal.case is None, key


CASES = {
    f"{path.removeprefix('stages/')}:{words}": r.case
    for (path, words), r in REFUSALS.items()
    if r.case is not None
}
# a GGUF header that cannot be read: refused where plan reads it (`engine/gguf_header.py`, light,
# which the stages read too); its other raises are caught in its parse as a damaged header
CASES.update(
    {
        "engine/gguf_header.py:not a GGUF file": Case(
            TINY.format(config="model: bad.gguf"),
            (
                "p.yaml:3:52: stages.t.config.model: 'bad.gguf' cannot be read as GGUF: not a "
                "GGUF file (it does not start with 'GGUF')",
            ),
            files=(("bad.gguf", "hello there"),),
        ),
        "engine/gguf_header.py:GGUF version": Case(
            TINY.format(config="model: v9.gguf"),
            (
                "p.yaml:3:52: stages.t.config.model: 'v9.gguf' cannot be read as GGUF: GGUF "
                "version 9; this reader knows versions 2 and 3",
            ),
            files=(("v9.gguf", "GGUF\t" + "\0" * 19),),
        ),
        "engine/gguf_header.py:a damaged GGUF header": Case(
            TINY.format(config="model: cut.gguf"),
            (
                "p.yaml:3:52: stages.t.config.model: 'cut.gguf' cannot be read as GGUF: a "
                "damaged GGUF header: 1 metadata entries and 0 tensors announced, not all readable",
            ),
            files=(("cut.gguf", "GGUF\3" + "\0" * 11 + "\1" + "\0" * 7),),
        ),
    }
)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("verb", ["plan", "validate"])
def test_plan_time_twin_refuses_the_same_condition(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verb: str, case: Case
) -> None:
    stub_checkpoint(tmp_path / "m")
    (tmp_path / "p.yaml").write_text(textwrap.dedent(case.yaml))
    for name, text in case.files:
        (tmp_path / name).write_text(text)
    if case.files:
        monkeypatch.syspath_prepend(str(tmp_path))
    args = [verb, "p.yaml", *(a for s in case.sets for a in ("--set", s))]
    if case.cluster:
        args += ["--cluster", case.cluster]
    result = run_cli(*args, cwd=tmp_path)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == list(case.lines)


def test_the_guides_70b_placement_starts_its_engines_as_planned() -> None:
    """pipelines/rl_70b_cluster.yaml on 6x8x80GB plans, and the vllm role's devices on each
    node split into the planned engines the run starts (no run-time refusal left)."""
    from stages.lib.backends.vllm.backend import VLLMBackend
    from stages.lib.backends.vllm.server import device_slices

    args = ("pipelines/rl_70b_cluster.yaml", "--cluster", "6x8x80GB", "--format", "json")
    result = run_cli("plan", *args, cwd=ROOT)
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)
    backend = VLLMBackend(**planned["stages"]["ppo"]["config"]["backend"])
    slots = [s for s in planned["placement"]["ppo"] if s["role"] == "vllm"]
    engines = [
        device_slices(backend, len(s["devices"]), [str(d) for d in s["devices"]]) for s in slots
    ]
    assert [len(e) for e in engines] == [1, 1]  # two nodes, an engine of 4 x 2 GPUs on each
    assert sum(len(e) for e in engines) == backend.vllm_num_engines == 2
    assert all(len(group) == backend.engine_size == 8 for e in engines for group in e)


def test_a_user_module_is_found_where_the_run_imports_it_and_none_of_its_code_runs(
    tmp_path: Path,
) -> None:
    """A predicate beside the pipeline (the run puts its folder first on the path) and an
    installed verifier pass; a package is looked into without importing it."""
    import sys

    (tmp_path / "keepers.py").write_text("def keep(row):\n    return True\n")
    (tmp_path / "boom").mkdir()
    (tmp_path / "boom" / "__init__.py").write_text("raise RuntimeError('imported at plan time')\n")
    (tmp_path / "boom" / "rules.py").write_text("def keep(row):\n    return True\n")
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(
            """\
            name: p
            stages:
              a: {kind: filter, config: {input: x.jsonl, predicate: "keepers:keep"}}
              b: {kind: filter, config: {input: x.jsonl, predicate: "boom.rules:keep"}}
              c: {kind: filter, config: {input: x.jsonl, predicate: "boom.nope:keep"}}
              r: {kind: rl, config: {input: x.jsonl, verifier: {kind: "stages.lib.verify:extract_answer"}}}
            """
        )
    )
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.stderr.splitlines() == [
        "p.yaml:5:57: stages.c.config.predicate: predicate 'boom.nope:keep': no module named "
        "'boom.nope'",
    ]
    assert "boom" not in sys.modules and "keepers" not in sys.modules


def test_a_user_class_is_found_in_its_module_source_without_running_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment's class is looked up in its module's source, read and not run: a
    `class`, an assignment or an import binding the name passes, a missing one is refused at
    its line; a star import cannot say, so the run decides. A module without source (a
    sourceless .pyc) is imported, as the run would."""
    import py_compile
    import sys

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "envs.py").write_text(
        "raise RuntimeError('imported at plan time')\n"
        "class MathEnv:\n    pass\n"
        "Alias = MathEnv\n"
        "from json import JSONDecoder as Decoder\n"
    )
    (tmp_path / "starred.py").write_text("from json import *\n")
    source = tmp_path / "src.py"
    source.write_text("class Compiled:\n    pass\n")
    py_compile.compile(str(source), cfile=str(tmp_path / "compiled.pyc"))
    source.unlink()
    lines = [
        ("a", "envs:MathEnv"),
        ("b", "envs:Alias"),
        ("c", "envs:Decoder"),
        ("d", "envs:MathEnvironment"),
        ("e", "starred:Anything"),
        ("f", "compiled:Compiled"),
        ("g", "compiled:Missing"),
    ]
    stages = "".join(
        f'  {n}: {{kind: rl, config: {{input: x.jsonl, environment: {{kind: "{k}", '
        "max_turns: 2}}}\n"
        for n, k in lines
    )
    (tmp_path / "p.yaml").write_text(f"name: p\nstages:\n{stages}")
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.stderr.splitlines() == [
        "p.yaml:6:62: stages.d.config.environment.kind: environment 'envs:MathEnvironment': "
        "module 'envs' has no class 'MathEnvironment'",
        "p.yaml:9:62: stages.g.config.environment.kind: environment 'compiled:Missing': "
        "module 'compiled' has no class 'Missing'",
    ]
    assert "envs" not in sys.modules and "starred" not in sys.modules
    sys.modules.pop("compiled", None)

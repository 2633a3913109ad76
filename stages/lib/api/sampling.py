"""Every sampling field a request to an OpenAI-compatible server carries, none left to it.

A vLLM server fills a field a request leaves out from its defaults, which by default
(`--generation-config auto`) are the checkpoint's `generation_config.json`: vLLM's
`ModelConfig.get_diff_sampling_param` takes repetition_penalty, temperature, top_k, top_p
and min_p from it, and `CompletionRequest.to_sampling_params` uses them for what the request
does not say. A Qwen2.5-Instruct checkpoint would so sample every answer with top_k 20,
top_p 0.8 and repetition_penalty 1.05. So the servers a stage starts run with
`--generation-config vllm` (`SERVER_ARGS`: vLLM's neutral defaults), and every request
carries every field besides (`request_sampling`).

A server the stage did not start (`backend: openai`) gets OpenAI's own fields only
(temperature, top_p, presence and frequency penalties): OpenAI's API refuses a request
carrying `top_k`, `min_p` or `repetition_penalty` (400, unrecognized argument). A vLLM server
someone else started should then run with `--generation-config vllm` itself
(docs/rl/on-policy.md).

`top_k: -1` is "off" (vLLM 0.32 also takes 0 and prefers it; older vLLM and SGLang take only
-1; vLLM's input batch treats any value outside 1..vocab-1 as the whole vocabulary).
"""

from __future__ import annotations

SERVER_ARGS = ("--generation-config", "vllm")
TOP_K_OFF = -1


def request_sampling(
    temperature: float, top_p: float = 1.0, vllm: bool = True
) -> dict[str, float | int]:
    """The sampling fields of a request at `temperature` and nucleus mass `top_p`, the rest
    neutral: no top-k, no min-p, no repetition, presence or frequency penalty. `vllm` False
    (a plain OpenAI-compatible server): OpenAI's fields only."""
    if not vllm:
        return {
            "temperature": temperature,
            "top_p": top_p,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
        }
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": TOP_K_OFF,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }

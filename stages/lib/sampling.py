"""Every sampling field a request to an OpenAI-compatible server carries, none left to it.

A vLLM server fills a field a request leaves out from its defaults, which by default
(`--generation-config auto`) are the checkpoint's `generation_config.json`: vLLM's
`ModelConfig.get_diff_sampling_param` takes repetition_penalty, temperature, top_k, top_p
and min_p from it, and `CompletionRequest.to_sampling_params` uses them for what the request
does not say. A Qwen2.5-Instruct checkpoint would so sample every answer with top_k 20,
top_p 0.8 and repetition_penalty 1.05. So the servers a stage starts run with
`--generation-config vllm` (`SERVER_ARGS`: vLLM's neutral defaults), and every request
carries every field besides (`request_sampling`), so a server started by someone else
(`backend: openai`) samples what was asked too.

`top_k: -1` is "off" (vLLM 0.32 also takes 0 and prefers it; older vLLM and SGLang take only
-1; vLLM's input batch treats any value outside 1..vocab-1 as the whole vocabulary).
"""

from __future__ import annotations

SERVER_ARGS = ("--generation-config", "vllm")
TOP_K_OFF = -1


def request_sampling(temperature: float, top_p: float = 1.0) -> dict[str, float | int]:
    """The sampling fields of a request at `temperature` and nucleus mass `top_p`, the rest
    neutral: no top-k, no min-p, no repetition, presence or frequency penalty."""
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": TOP_K_OFF,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }

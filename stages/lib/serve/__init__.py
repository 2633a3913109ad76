"""A model pipe holds in memory, served over HTTP as an OpenAI-compatible endpoint (the policy
endpoint NeMo Gym's `vllm_model` server calls): chat completions with tools, structured tool
calls and log-probs with token ids, `/v1/models` and `/tokenize`.

Input: an engine (prompts + sampling -> generations with token ids and log-probs: the local
backend's `generate_with`, or any function of that shape), its tokenizer and the tool-call
parser of its chat template.
Output: a running server at a base URL (`http://127.0.0.1:<port>/v1`), stopped by its owner.
"""

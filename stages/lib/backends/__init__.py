"""Generation backends: one module per backend behind one protocol, registered like stage kinds.

Input: a stage's `backend:` block (its `kind` names the backend) and what the stage hands it
(resolve context, devices, a checkpoint folder). Output: the validated block, its plan
answers, and where the stage's requests go (an HTTP endpoint it opens, or an in-process
generator).

- `protocol`: the protocol (`BackendConfig`): a backend's config block with its rules, its plan
  hooks, where its requests go (`open_endpoint` or `in_process`) and what rl needs of it.
- `registered`: the `pipe.backends` entry points (and `register_backend`), the `Backend` field
  kinds declare, and `BackendStageConfig` (a kind's hooks answered by its backend).
- `openai`, `local`, `vllm/`: the built-ins; `vllm/backend.py` is the block, `server.py`,
  `process.py`, `auth.py` and `worker_ext.py` what it runs (the last two inside vLLM's server).
- `endpoint`: an open HTTP endpoint and the client for it.

Stage kinds import this package; it imports no kind. Nothing imported here: vLLM's server
imports `vllm.auth` and `vllm.worker_ext` through this package in its own interpreter.
"""

"""Code the stage kinds share, grouped by concern in sub-packages: `model` (checkpoints),
`build` (models built from config), `chat` (templates and token ids), `api` (OpenAI-compatible
requests), `vllm` (vLLM servers), `dist` (rank processes), `env` (environments) and `io`
(files and metric events); at the top, the config pieces several kinds declare (`config`),
verifiers (`verify`), devices (`devices`) and ports (`net`).

Input: what a kind hands each piece (its resolved config, paths, devices).
Output: what each piece returns; nothing here imports a kind.
"""

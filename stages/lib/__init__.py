"""Code the stage kinds share, grouped by concern in sub-packages: `backends` (generation
backends: openai, vllm, local, and plugins; each its block, rules, servers and endpoint),
`model` (checkpoints), `builders` (models built from config), `chat` (templates and token
ids), `api` (OpenAI-compatible requests), `distributed` (rank processes), `env`
(environments) and `io` (files and metric events). At the top: `block` (what every config
block is built from), `config` (the verifier block kinds declare), `verify` (verifiers),
`devices` and `net` (ports).

Input: what a kind hands each piece (its resolved config, paths, devices).
Output: what each piece returns; nothing here imports a kind.
"""

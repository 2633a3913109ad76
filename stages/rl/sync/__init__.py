"""Weight sync: the actor's new weights into every rollout engine after each update.

Input: the actor's parameters (rank 0 sends; ZeRO-3 ranks gather). Output: every engine
holding the same weights, checked on a probe.

- `choice`: which backend runs and why (one rule for `pipe plan` and the run).
- `backends`: the collective (gloo, nccl) and the disk, into a local engine; the probe
  check.
- `vllm`: the same into vLLM servers' workers.

Imports no engine and no controller: the vLLM side reaches the servers through the small
`VLLMEngine` protocol (`sync.vllm`) the vLLM engines satisfy.
"""

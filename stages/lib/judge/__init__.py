"""The LLM judge: a verifier (`verifier: {kind: judge, ...}`) whose scores an LLM gives.

Input: a `stages.lib.config.Verifier` of kind judge (its backend, template, score rule and
range) and the run folder. Output: `grader.Judge`, a verifier's `score(row, completion)`
that also scores many pairs at once (`score_many`), concurrently. Parts: `reading` (the
judge's prompt rendered, its answer read into a score), `answers` (the judge's answers,
cached in the run folder), `grader` (the requests: a served judge over HTTP through
`over_http`, a local one in batches).
"""

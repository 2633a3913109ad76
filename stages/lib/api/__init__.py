"""The OpenAI-compatible side of a stage: the HTTP client, the endpoint a backend names, the
sampling fields every request carries, and adaptive concurrency (`num_samples_in_parallel: auto`).

Input: a backend config (`openai` or `vllm`), sampling settings and requests to send.
Output: completions (or request errors) with usage and latency, and the in-flight limit.
"""

"""vLLM's OpenAI server as a stage starts it: the server process, the run's secret checked
inside it, and the worker extension that receives weights for the rl stage's sync.

Input: a `VLLMBackend` config, a checkpoint folder and the devices the stage holds.
Output: running servers' base URLs (stopped with their whole process group at the stage's end)
and, inside the server, weights loaded in place from a process group.
"""

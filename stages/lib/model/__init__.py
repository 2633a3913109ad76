"""Checkpoints as the stages read and write them: the `model:` field, plan-time path checks,
dtypes, the final save, logits where a loss reads them, and batched local generation.

Input: a checkpoint folder (or a `model:` field naming one) and a stage's precision settings.
Output: loaded models and tokenizers in the resolved dtype, generations with their token ids
and log-probabilities, and saved checkpoint folders with the input's other files kept.
"""

"""The chat format every stage shares: one template for training and generation, and the
token ids a checkpoint's conventions fix (where an answer ends, what stops generation, what pads).

Input: a tokenizer with its chat template, and rows (a `prompt` string or `messages`).
Output: rendered prompt text and ids, stop ids, pad id, and the ids of an answer's end.
"""

"""Models and tokenizers built offline from config: the tiny model of the quickstart, the
four families' test checkpoints (ChatML, Llama 3, Gemma, Mistral) and their release conventions
as data, and byte-level BPE tokenizers trained locally.

Input: a `TinyModel` or `FamilyModel` spec (architecture sizes, family, seed).
Output: a checkpoint folder (`config.json`, weights, tokenizer files, chat template,
`generation_config.json`) that every stage loads like a downloaded one.
"""

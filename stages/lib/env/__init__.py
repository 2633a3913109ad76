"""Environments: multi-turn episodes between a model and something that answers back. The
contract (`reset`, `step`), the `environment:` block, the built-in environments and the HTTP
client of a served one, and episodes played at the level of messages.

Input: an `environment:` block (`module:Class` or `url`) and prompt rows.
Output: episodes (messages, per-turn rewards, total, turns) and their summary.
"""

"""Files every kind reads and writes, and the metric events a stage hands to the trackers.

Input: paths and rows (JSONL), per-step metrics.
Output: JSONL read as a stream or written atomically, and `track.jsonl` metric events.
"""

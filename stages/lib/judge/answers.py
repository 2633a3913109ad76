"""The judge's answers, cached in the run folder: a re-run or a repeated answer costs nothing.

Input: the run folder, and per answer its key, a hash of (judge model, template, question,
answer). Output: `JudgeCache`, the judge's answer text for a key seen before (from this run
or an earlier one, `--force` included: the file lives in the run folder beside
`.pipe-models`, not in a stage's folder). It keeps
the judge's text rather than the score, so a changed `score_regex` or `score_range` reads the
same answers anew. The file is JSON lines, appended one whole line per write, so stages and
shards writing at once interleave lines, never bytes of them; a torn last line is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading

CACHE_FILE = ".pipe-judge.jsonl"  # in the run folder, beside .pipe-models


def cache_key(model: str, template: str, question: str, answer: str) -> str:
    """The hash of what the judge's answer depends on."""
    text = json.dumps([model, template, question, answer], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class JudgeCache:
    """The judge's answers by key; `path` None keeps them in memory only."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._answers: dict[str, str] = {}
        if path is not None and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                        self._answers[str(record["key"])] = str(record["text"])
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by a killed writer

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._answers.get(key)

    def put(self, key: str, text: str) -> None:
        with self._lock:
            self._answers[key] = text
            if self.path is None:
                return
            line = json.dumps({"key": key, "text": text}, ensure_ascii=False) + "\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)

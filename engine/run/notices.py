"""Libraries' notices into the stage's log: what third-party code logs or warns while a
stage runs goes to its `log.txt`, not to the terminal.

Input: the stage's file handlers. Output, while `routed(handlers)` is open: the records of
the libraries' loggers (`LIBRARIES`: transformers' "Ignoring clean_up_tokenization_spaces=True
for BPE tokenizer", huggingface_hub's, peft's, ...) and Python's warnings (through
`logging.captureWarnings`, the logger `py.warnings`) reach those handlers only. A library's
own console handler is muted for the while: transformers adds one when it is first imported,
which may be during the stage, after this opened, so the handler this puts on the library's
logger (first in its list) mutes the ones beside it as each record passes, before they see
it. Nothing is imported: the loggers are named. When it closes, every logger is as it was
(a library's records then reach its console handler again, as outside a stage).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

LIBRARIES = (
    "transformers",
    "huggingface_hub",
    "tokenizers",
    "datasets",
    "peft",
    "accelerate",
    "torch",
)
WARNINGS = "py.warnings"  # where `logging.captureWarnings` sends `warnings.warn`


class _Mute(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


_MUTE = _Mute()


class _ToStage(logging.Handler):
    """On a library's logger: its records to the stage's handlers, its console handlers
    (any `StreamHandler` but a file's) muted."""

    def __init__(self, logger: logging.Logger, targets: Sequence[logging.Handler]) -> None:
        super().__init__()
        self.logger, self.targets = logger, list(targets)
        self.muted: list[logging.Handler] = []
        self.before = set(logger.handlers)  # a handler added later: the library set itself up
        self.propagate = logger.propagate

    def mute_console(self) -> None:
        for h in self.logger.handlers:
            console = isinstance(h, logging.StreamHandler) and not isinstance(
                h, logging.FileHandler
            )
            if h is not self and console and _MUTE not in h.filters:
                h.addFilter(_MUTE)
                self.muted.append(h)

    def emit(self, record: logging.LogRecord) -> None:
        self.mute_console()  # a handler the library added since, before it sees this record
        for h in self.targets:
            if record.levelno >= h.level:
                h.handle(record)

    def restore(self) -> None:
        """The logger as it was, but for what the library did meanwhile: a library that set
        up its console handler during the stage also stopped propagation (transformers
        does), which stays."""
        for h in self.muted:
            h.removeFilter(_MUTE)
        self.logger.removeHandler(self)
        if not set(self.logger.handlers) - self.before:
            self.logger.propagate = self.propagate


@contextlib.contextmanager
def routed(handlers: Sequence[logging.Handler]) -> Iterator[None]:
    """While open, the libraries' records and Python's warnings go to `handlers` alone
    (module docstring); with no handlers (a stage folder on remote storage), as they were."""
    if not handlers:
        yield
        return
    routes = []
    for name in (*LIBRARIES, WARNINGS):
        logger = logging.getLogger(name)
        route = _ToStage(logger, handlers)
        logger.handlers.insert(0, route)  # first: it mutes the console before it is reached
        route.mute_console()
        logger.propagate = False  # not on to the root logger's console either
        routes.append(route)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for route in routes:
            route.restore()

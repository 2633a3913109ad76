"""The `pipe` command: a thin shell over load -> resolve -> plan -> execute.

Exit codes: 0 ok; 1 a stage failed; 2 an invalid pipeline or usage. A user's
mistake prints compiler-style errors and no traceback; `-v` shows one for a bug.

Inside: `shell` (the command group, logging, exit codes, plugin commands), `commands` (the
built-in commands) and `build` (a pipeline planned without running it, for `validate` and
`plan`). `python -m engine.cli` runs it too.
"""

from engine.cli.commands import graph, plan_cmd, presets, run, schema, stages, validate
from engine.cli.shell import main

for _command in (validate, plan_cmd, run, presets, schema, stages, graph):
    main.add_command(_command)

__all__ = ["main"]

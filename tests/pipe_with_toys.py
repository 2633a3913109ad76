"""`pipe` with the toy stage kinds of tests/kinds.py registered (for subprocess tests)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cli import main
from tests.kinds import register

register()

if __name__ == "__main__":
    main()

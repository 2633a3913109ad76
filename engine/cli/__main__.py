"""`python -m engine.cli`: the `pipe` command."""

from engine.cli import main

if __name__ == "__main__":
    main()

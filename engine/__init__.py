"""pipe's engine: load -> resolve -> plan -> execute, and the CLI."""

__version__ = "0.1.0"

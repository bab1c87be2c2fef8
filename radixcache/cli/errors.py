"""The command's two errors, in a module of their own so that every subcommand's module can
raise them without importing the parser (which imports the subcommands' flags)."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """A bad argument found after parsing (exit code 2)."""


class ParseError(Exception):
    """argparse's complaint, with the (sub)command parser it belongs to."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser

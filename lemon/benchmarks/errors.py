"""Exceptions raised by :mod:`lemon.benchmarks`."""

from __future__ import annotations


class UnknownBenchmarkError(ValueError, KeyError):
    """An unknown benchmark name; the message lists the valid names.

    Subclasses both ``ValueError`` and ``KeyError`` so callers can catch either.
    """

    def __str__(self) -> str:  # KeyError would repr() the message otherwise
        return str(self.args[0]) if self.args else ""


class UnknownSplitError(ValueError, KeyError):
    """An unknown split for a known benchmark; the message lists the valid splits."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DataNotFoundError(FileNotFoundError):
    """Neither the local JSONL mirror nor the Hugging Face ``datasets`` fallback worked."""

"""What a refusal is: a setting that cannot run, found by every rank alike.

What this file teaches: a bad setting is not a crash. Every rank checks the same flags
against the same world size and the same files, without talking, so every rank reaches
the same verdict at the same point; then rank 0 says it in one line and every rank
exits 2 (`log.refuse_together`, the command line's `fail`). An exception of this kind
means exactly that promise; `config.ConfigError` is one.
"""

from __future__ import annotations


class RefusalError(Exception):
    """A setting that cannot run, raised on every rank alike; its message is one line."""

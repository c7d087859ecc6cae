"""The errors a user can act on, at the bottom of the house (every layer raises them): each message is one
line that names the file, key or value and the fix. The launch scripts turn them into one `error:` line:
`ConfigError` and `DataError` (a mistake in the recipe or the data) exit 2, `RunError` (a failure during
the run: a diverged loss, a full disk, an unreadable checkpoint) exits 1."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing configuration mistake; its message is one line that says how to fix it."""


class DataError(ValueError):
    """A problem with the user's data; the message is one line naming file, line and column."""


class RunError(RuntimeError):
    """A failure during training that the user can act on; its message is one line."""

"""The errors a user can act on, at the bottom of the house (every layer raises them): each message is one
line that names the file, key or value and the fix. The launch scripts turn them into one `error:` line:
`ConfigError` and `DataError` (a mistake in the recipe or the data) exit 2, `RunError` (a failure during
the run: a diverged loss, a full disk, an unreadable checkpoint) exits 1."""

from __future__ import annotations

import errno


class ConfigError(ValueError):
    """A user-facing configuration mistake; its message is one line that says how to fix it."""


class DataError(ValueError):
    """A problem with the user's data; the message is one line naming file, line and column."""


class RunError(RuntimeError):
    """A failure during training that the user can act on; its message is one line."""


def disk_full(error: BaseException) -> bool:
    """Whether `error` from a write, or an error it was raised from, is a full disk (or an exhausted quota;
    "inline_container" also names a corrupt file when *reading*, so ask only about writes). Each writer
    says it its own way: an `OSError` with errno ENOSPC/EDQUOT from a plain write, safetensors' own
    `SafetensorError("... No space left on device (os error 28)")` (not an OSError), and torch.save's zip
    writer a `RuntimeError` ("[enforce fail at inline_container.cc] ... unexpected pos", "PytorchStreamWriter
    failed ...") that names no errno at all."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text:
            return True
        if isinstance(error, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter failed" in text
                                                or "file write failed" in text):
            return True
        error = error.__cause__ or error.__context__
    return False


def first_line(e: BaseException, limit: int = 160) -> str:
    """An exception's first line, for a one-line message (its class name when it has no text)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]

"""The data.*_column keys: which key names a column, and the one-line error for a column the data lacks, naming
the place, the columns present and the key that maps it (`data.prompt_column=question`)."""

from __future__ import annotations

from typing import Any, Iterable

from rl.errors import DataError

# what a data.*_column key names, and the columns that usually hold it: the fix a missing column's message proposes
COLUMN_SYNONYMS = {
    "prompt_column": ("prompt", "question", "query", "instruction", "input", "problem"),
    "text_column": ("text", "content", "prompt", "question", "query", "instruction", "input", "problem"),
    "completion_column": ("completion", "answer", "response", "output", "solution"),
    "chosen_column": ("chosen", "preferred", "positive", "accepted"),
    "rejected_column": ("rejected", "dispreferred", "negative"),
    "label_column": ("label", "desirable", "is_desirable"),
    "messages_column": ("messages", "conversations", "conversation", "chat"),
}


def column_keys(data_section: Any) -> dict[str, str]:
    """{column name: the data.*_column key that names it} of a DataSection (the first key, where two name one)."""
    out: dict[str, str] = {}
    for field in COLUMN_SYNONYMS:
        value = getattr(data_section, field, None)
        if isinstance(value, str):
            out.setdefault(value, f"data.{field}")
    return out


def missing_column(location: str, col: str, present: Iterable[str], key: str | None) -> DataError:
    """`file:line: no column 'x' (columns present: ...); set data.prompt_column=question, ...`: where it was looked
    for (`rl.data.records.where` of the first row), the columns there are and the key that maps it, with the
    likeliest column when one is there."""
    present = sorted(present)
    field = (key or "").rsplit(".", 1)[-1]
    guess = next((c for c in COLUMN_SYNONYMS.get(field, ()) if c in present and c != col), None)
    if key is None:
        fix = "rename the column in the data"
    elif guess:
        fix = f"set {key}={guess} if that column holds it, or rename the column in the data"
    else:
        fix = f"set {key}=<the column that holds it>, or rename the column in the data"
    return DataError(f"{location}: no column '{col}' (columns present: {', '.join(present) or 'none'}); {fix}")

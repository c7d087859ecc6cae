"""Loading and validating training data: JSONL/JSON/CSV/Parquet files, saved `datasets` dirs, and
dataset repositories (a Hugging Face Hub id such as `trl-lib/Capybara`, or a local folder laid out like
one: data files and/or a README.md with YAML `configs`), read through `datasets.load_dataset` with a
config name (`data.name`) and a split (`data.split`).

Every problem is reported before training starts, as a `DataError` whose message names the file, the
line (for JSONL/JSON/CSV) and the column, and says how to fix it. Records keep their source line in
`_line` so that later checks (an empty answer, chosen == rejected) can name it too.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

logger = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # `name` or `owner/name`


class DataError(ValueError):
    """A problem with the user's data; the message is one line naming file, line and column."""


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, path, lineno)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
            row["_line"] = lineno
            rows.append(row)
    return rows


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    """One line of a data file as text; invalid UTF-8 is a DataError naming the line and byte column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: invalid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                        f"re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _read_json(path: Path) -> list[dict]:
    text = "".join(_decode(raw, path, i) for i, raw in enumerate(path.read_bytes().splitlines(True), start=1))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{path}: expected a JSON list of objects (or {{\"data\": [...]}})")
    # A JSON array has no per-record line; use the 1-based record index and say so.
    return [{**r, "_line": f"record {i}"} for i, r in enumerate(data, start=1)]


def _is_saved_dataset(path: Path) -> bool:
    """True for a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return (path / "state.json").exists() or (path / "dataset_dict.json").exists()


def _looks_like_hub_id(path: str) -> bool:
    """`name` or `owner/name` without a data-file suffix: what the Hub accepts as a dataset id."""
    return bool(HUB_ID.fullmatch(path)) and not path.lower().endswith(SUFFIXES)


def _numbered(ds, label: str) -> list[dict]:
    return [{**r, "_line": f"{label}{i}"} for i, r in enumerate(ds, start=1)]


def _read_saved(path: Path, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises several types here
        raise DataError(f"{path}: not a saved datasets directory ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: a DatasetDict without a '{split}' split (splits: {', '.join(ds)}); "
                            f"set data.split (or data.eval_split for eval_path)")
        ds = ds[split]
    return _numbered(ds, "row ")


def _read_repository(path: str, name: str | None, split: str) -> list[dict]:
    """One split of a dataset repository (a Hub id or a local folder) through `datasets.load_dataset`.

    Every failure is one DataError line: offline or unreachable Hub, unknown dataset, config or split."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    local = Path(path).is_dir()
    try:
        ds = datasets.load_dataset(path, name, split=split)
    except ConnectionError:
        raise DataError(f"{path}: not a local file or folder, and the Hugging Face Hub could not be reached to "
                        f"load it as a hub dataset (offline: HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set, or no "
                        f"network); fix data.path, or download the dataset where there is network (`hf download "
                        f"{path} --repo-type dataset --local-dir DIR`) and set data.path to DIR") from None
    except (DatasetNotFoundError, FileNotFoundError) as e:
        what = "data files in the folder" if local else "a local file or folder, and not a dataset on the Hub"
        raise DataError(f"{path}: no {what} ({str(e).splitlines()[0]}); set data.path to a "
                        f".jsonl/.json/.csv/.parquet file, a dataset folder or a hub id") from None
    except ValueError as e:  # an unknown config or split, a missing config name: datasets names them
        key = "data.split (or data.eval_split)" if "split" in str(e).lower() else "data.name"
        raise DataError(f"{path}: {str(e).splitlines()[0].rstrip('.')} (set {key})") from None
    return _numbered(ds, f"{split} row ")


def _read_file_with_datasets(path: Path) -> list[dict]:
    import datasets

    kind = path.suffix.lstrip(".")
    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: could not read as {kind} ({e})") from None
    first = 2 if kind == "csv" else 1  # CSV line 1 is the header
    label = "" if kind == "csv" else "row "
    return [{**r, "_line": f"{label}{i}" if label else i} for i, r in enumerate(ds, start=first)]


def read_records(path: str | Path, *, name: str | None = None, split: str | None = None) -> list[dict]:
    """All rows of a data source as dicts (with `_line`), without column checks.

    `path` is a data file, a saved `datasets` directory, a local dataset folder (data files and/or a
    README.md with YAML `configs`, as on the Hub) or a Hub dataset id. `name` (the config, data.name)
    and `split` (default "train") apply to the last three; a single file is its only split."""
    split = split or "train"
    p = Path(path)
    if not p.exists():
        if _looks_like_hub_id(str(path)):
            return _read_repository(str(path), name, split)
        raise DataError(f"data file not found: {path} (set data.path to a .jsonl/.json/.csv/.parquet file, "
                        f"a dataset folder or a hub id such as trl-lib/Capybara)")
    if p.is_dir():
        return _read_saved(p, split) if _is_saved_dataset(p) else _read_repository(str(p), name, split)
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(p)
    if suffix == ".json":
        return _read_json(p)
    if suffix in (".csv", ".parquet"):
        return _read_file_with_datasets(p)
    raise DataError(f"{path}: unsupported file type '{suffix}' (use one of {', '.join(SUFFIXES)}, "
                    f"a directory written by datasets' save_to_disk, a dataset folder or a hub id)")


def source_options(data_section: Any, for_eval: bool = False) -> dict:
    """`read_records` keywords for data.path (or, with `for_eval`, data.eval_path) of a DataSection:
    the config name and the split (data.split / data.eval_split)."""
    d = data_section
    return {"name": d.name, "split": d.eval_split if for_eval else d.split}


def load_records(path: str | Path, columns: Iterable[str], *, optional: Iterable[str] = (),
                 chat_columns: Iterable[str] = (), max_examples: int | None = None,
                 name: str | None = None, split: str | None = None) -> list[dict]:
    """Rows of `path` restricted to `columns` (required) and `optional` ones, validated.

    Required columns must exist in the data and hold non-empty strings; a column listed in
    `chat_columns` may instead hold a list of {"role", "content"} messages. `name`/`split`: see
    `read_records`."""
    columns, optional, chat = list(columns), list(optional), set(chat_columns)
    rows = read_records(path, name=name, split=split)
    if not rows:
        raise DataError(f"{path}: no examples (the file is empty)")
    present = sorted({k for r in rows[:1000] for k in r if k != "_line"})
    for col in columns:
        if col not in present:
            raise DataError(f"{path}: missing column '{col}' (columns present: {', '.join(present) or 'none'}); "
                            f"rename it in the data or set the matching data.*_column key")
    out = []
    for row in rows[:max_examples] if max_examples else rows:
        where = f"{path}:{row['_line']}" if isinstance(row["_line"], int) else f"{path} ({row['_line']})"
        rec = {"_line": row["_line"]}
        for col in columns + [c for c in optional if c in row]:
            value = row.get(col)
            if col in chat and isinstance(value, list):
                _check_messages(value, where, col)
            elif not isinstance(value, str):
                got = "missing" if value is None else type(value).__name__
                raise DataError(f"{where}: column '{col}' must be a string, got {got}")
            elif col in columns and not value.strip():
                raise DataError(f"{where}: column '{col}' is empty")
            rec[col] = value
        out.append(rec)
    return out


def _check_messages(messages: list, where: str, col: str) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: column '{col}' message {i} must be {{\"role\": str, \"content\": str}}")


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Messages -> text with the tokenizer's own chat template (error if it has none)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("chat-format data needs a tokenizer with a chat template; this model's tokenizer "
                        "has none (use plain text columns or a chat model)")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def with_bos(tokenizer, ids: list[int]) -> list[int]:
    """`ids` with the tokenizer's BOS first, exactly once: a chat template may render it itself
    (ChatML's `<|im_start|>` is SmolLM2's BOS), and a second copy is a sequence the model never saw."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return list(ids) if bos is None or list(ids[:1]) == [bos] else [bos] + list(ids)


@dataclass
class LengthReport:
    """Counts examples that did not fit `max_length` (truncated, or rejected when strict)."""

    max_length: int
    strict: bool = False
    seen: int = 0
    truncated: int = 0

    def fit(self, ids: list[int], where: str = "") -> list[int]:
        self.seen += 1
        if len(ids) <= self.max_length:
            return ids
        if self.strict:
            raise DataError(f"{where}: example has {len(ids)} tokens > max_length={self.max_length} "
                            f"(raise max_length or set data.strict=false to truncate)")
        self.truncated += 1
        return ids[: self.max_length]

    def log(self, what: str = "examples") -> None:
        if self.truncated:
            logger.warning("%d of %d %s were longer than max_length=%d and were truncated",
                           self.truncated, self.seen, what, self.max_length)


def where(path: Any, row: dict) -> str:
    """'file:line' for messages about one record."""
    line = row.get("_line")
    return f"{path}:{line}" if isinstance(line, int) else f"{path} ({line})"

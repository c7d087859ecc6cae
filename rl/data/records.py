"""Loading and validating training data: JSONL/JSON/CSV/Parquet files, saved `datasets` dirs, and
dataset repositories (a Hugging Face Hub id such as `trl-lib/Capybara`, or a local folder laid out like
one: data files and/or a README.md with YAML `configs`), read through `datasets.load_dataset` with a
config name (`data.name`) and a split (`data.split`), optionally streamed (`data.streaming`: only the
first `data.max_examples` rows are fetched). `data.mixture` draws rows from several such sources in
proportion to their weights (`mix_rows`).

Every problem is reported before training starts, as a `DataError` whose message names the file, the
line (for JSONL/JSON/CSV) and the column, and says how to fix it. Records keep their source line in
`_line` so that later checks (an empty answer, chosen == rejected) can name it too.

Shared by the data modules and the online trainers' prompts: `render_chat` (messages through the
tokenizer's own chat template), `with_bos` (BOS exactly once), `LengthReport` (examples that did not fit
`max_length`), `where` ('file:line' of a row) and `split_eval` (a seeded held-out fraction).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from itertools import islice
from pathlib import Path
from typing import Any, Iterable

import torch

from rl.data.chat import check_messages
from rl.data.columns import missing_column
from rl.errors import DataError

logger = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
MIXTURE = "data.mixture"  # the label of a mixture's rows in messages that name no single source
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # `name` or `owner/name`


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


def _read_repository(path: str, name: str | None, split: str, streaming: bool = False,
                     limit: int | None = None) -> list[dict]:
    """One split of a dataset repository (a Hub id or a local folder) through `datasets.load_dataset`;
    with `streaming`, an IterableDataset of which only the first `limit` rows are fetched (a huge Hub
    dataset is not downloaded whole).

    Every failure is one DataError line: offline or unreachable Hub, unknown dataset, config or split."""
    import datasets
    from datasets.exceptions import DatasetGenerationError, DatasetNotFoundError

    local = Path(path).is_dir()
    try:
        ds = datasets.load_dataset(path, name, split=split, streaming=streaming)
        rows = list(islice(ds, limit)) if streaming else ds  # the iteration is where a stream reads
    except ConnectionError:
        raise DataError(f"{path}: not a local file or folder, and the Hugging Face Hub could not be reached to "
                        f"load it as a hub dataset (offline: HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set, or no "
                        f"network); fix data.path, or download the dataset where there is network (`hf download "
                        f"{path} --repo-type dataset --local-dir DIR`) and set data.path to DIR") from None
    except RuntimeError as e:  # a loading script: datasets no longer runs them (nothing was run)
        if "script" not in str(e).lower():
            raise
        raise DataError(f"{path}: {str(e).splitlines()[0].rstrip('.')}; the script was not run (datasets runs no "
                        f"loading scripts): convert the data to .jsonl/.parquet files or use a dataset without "
                        f"a script") from None
    except (DatasetNotFoundError, FileNotFoundError) as e:
        what = "data files in the folder" if local else "a local file or folder, and not a dataset on the Hub"
        raise DataError(f"{path}: no {what} ({str(e).splitlines()[0]}); set data.path to a "
                        f".jsonl/.json/.csv/.parquet file, a dataset folder or a hub id") from None
    except DatasetGenerationError as e:  # a data file the builder cannot parse; the cause says which
        cause = str(e.__cause__ or e).splitlines()[0]
        raise DataError(f"{path}: could not read its data files ({cause}); fix or remove the broken file") from None
    except ValueError as e:  # an unknown config or split, a missing config name: datasets names them
        key = "data.split (or data.eval_split)" if "split" in str(e).lower() else "data.name"
        raise DataError(f"{path}: {str(e).splitlines()[0].rstrip('.')} (set {key})") from None
    return _numbered(rows, f"{split} row ")


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


def read_records(path: str | Path | None, *, name: str | None = None, split: str | None = None,
                 streaming: bool = False, limit: int | None = None, mixture: list[dict] | None = None,
                 seed: int | None = None) -> list[dict]:
    """All rows of a data source as dicts (with `_line`), without column checks.

    `path` is a data file, a saved `datasets` directory, a local dataset folder (data files and/or a
    README.md with YAML `configs`, as on the Hub) or a Hub dataset id. `name` (the config, data.name)
    and `split` (default "train") apply to the last three; a single file is its only split.
    `limit`: at most this many rows. `streaming` (needs `limit`): a dataset repository is streamed and
    only its first `limit` rows are fetched; files and saved directories are local and read as usual.
    `mixture` (data.mixture, with `path` None): rows of several sources drawn by `mix_rows` with `seed`,
    `limit` rows in all; each row's `_line` is then its whole location (`a.jsonl:12`)."""
    if mixture:
        if seed is None:
            raise TypeError("read_records: a mixture needs the run's seed (source_options(..., seed=cfg.seed))")
        return _read_mixture(mixture, streaming, limit, seed)
    if streaming and not limit:
        raise DataError(f"{path}: data.streaming reads only the first data.max_examples rows; set "
                        f"data.max_examples (e.g. --data.max_examples 10000) or drop data.streaming")
    rows = _read_source(path, name, split or "train", streaming, limit)
    return rows[:limit] if limit else rows


def _read_source(path: str | Path, name: str | None, split: str, streaming: bool, limit: int | None) -> list[dict]:
    p = Path(path)
    if not p.exists():
        if _looks_like_hub_id(str(path)):
            return _read_repository(str(path), name, split, streaming, limit)
        raise DataError(f"data file not found: {path} (set data.path to a .jsonl/.json/.csv/.parquet file, "
                        f"a dataset folder or a hub id such as trl-lib/Capybara)")
    if p.is_dir():
        if _is_saved_dataset(p):
            return _read_saved(p, split)
        return _read_repository(str(p), name, split, streaming, limit)
    if name:  # a single file has no configs: data.name would be silently ignored
        raise DataError(f"{path}: data.name={name!r} names a config of a dataset repository (a Hub id or a dataset "
                        f"folder), and a single file has none; drop data.name or point data.path at the dataset")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(p)
    if suffix == ".json":
        return _read_json(p)
    if suffix in (".csv", ".parquet"):
        return _read_file_with_datasets(p)
    raise DataError(f"{path}: unsupported file type '{suffix}' (use one of {', '.join(SUFFIXES)}, "
                    f"a directory written by datasets' save_to_disk, a dataset folder or a hub id)")


def mixture_counts(weights: list[float], sizes: list[int], total: int | None) -> list[int]:
    """Rows to take from each source: `total` split in proportion to `weights` by largest remainder.

    With p_i = w_i / sum(w), the mixture can hold at most N* = min_i floor(size_i / p_i) rows before
    some source runs out, so N = min(total, N*) (N* alone without `total`). Source i gets
    floor(p_i N), and the N - sum floor(p_i N) rows left over go one each to the largest remainders
    p_i N - floor(p_i N) (ties: the earlier source). Exact fractions of the weights as written
    (Fraction("0.7") = 7/10, not the float's 0.6999...), so 0.7/0.3 of 10 is 7 and 3. A source never
    gets more than its size: p_i N <= size_i, and size_i is an integer, so even ceil(p_i N) fits.

    E.g. weights [0.7, 0.3], sizes [100, 6]: N* = min(100/0.7, 6/0.3) = min(142, 20) = 20 -> [14, 6]."""
    w = [Fraction(str(x)) for x in weights]
    p = [x / sum(w) for x in w]
    n = min(int(size / pi) for size, pi in zip(sizes, p))  # int() floors a non-negative Fraction
    n = min(n, total) if total is not None else n
    exact = [pi * n for pi in p]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(p)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:n - sum(counts)]:
        counts[i] += 1
    return counts


def mix_rows(sources: list[list[dict]], weights: list[float], total: int | None, seed: int) -> list[dict]:
    """Rows of `sources` mixed: `mixture_counts` rows of each, each source's rows in its own order (its
    first rows, which is all a stream fetched), the sources' turns shuffled with random.Random(seed).

    Exact proportions rather than a coin per row (as `datasets.interleave_datasets` draws): a 0.7/0.3
    mixture of 10 rows is 7 and 3 on every seed, and the seed only decides the order. The same seed
    gives the same rows in the same order."""
    counts = mixture_counts(weights, [len(s) for s in sources], total)
    turns = [i for i, c in enumerate(counts) for _ in range(c)]
    random.Random(seed).shuffle(turns)
    taken = [0] * len(sources)
    out = []
    for i in turns:
        out.append(sources[i][taken[i]])
        taken[i] += 1
    return out


def _read_mixture(mixture: list[dict], streaming: bool, limit: int | None, seed: int) -> list[dict]:
    """The rows of a data.mixture (entries {path, weight[, name, split]}, checked by DataSection), each
    with `_line` set to its full location so that errors name the source file and line."""
    if streaming and not limit:
        raise DataError(f"{MIXTURE}: data.streaming reads only the first data.max_examples rows; set "
                        f"data.max_examples or drop data.streaming")
    sources = []
    for entry in mixture:
        path = entry["path"]
        # no source supplies more than `limit` rows of the mixture, so reading more is never needed
        rows = read_records(path, name=entry.get("name"), split=entry.get("split"), streaming=streaming, limit=limit)
        sources.append([{**r, "_line": where(path, r)} for r in rows])
    if not all(sources):
        empty = next(e["path"] for e, s in zip(mixture, sources) if not s)
        raise DataError(f"{MIXTURE}: source {empty} has no rows; fix it or drop it from the mixture")
    rows = mix_rows(sources, [e["weight"] for e in mixture], limit, seed)
    if limit and len(rows) < limit:
        logger.warning("%s: %d rows, fewer than data.max_examples=%d: a source ran out at its weight "
                       "(sources: %s)", MIXTURE, len(rows), limit,
                       ", ".join(f"{e['path']} {len(s)} rows x {e['weight']}" for e, s in zip(mixture, sources)))
    return rows


def source_options(data_section: Any, for_eval: bool = False, seed: int | None = None) -> dict:
    """`read_records` keywords for data.path (or, with `for_eval`, data.eval_path) of a DataSection:
    the config name, the split (data.split / data.eval_split), streaming with its row limit
    (data.max_examples), and for the training data data.mixture with the run's `seed` (data.path is
    then None; a mixture is training data only, data.eval_path is read as a single source)."""
    d = data_section
    mixture = None if for_eval else getattr(d, "mixture", None)
    streaming = getattr(d, "streaming", False)
    return {"name": d.name, "split": d.eval_split if for_eval else d.split, "streaming": streaming,
            "limit": d.max_examples if streaming or mixture else None, "mixture": mixture, "seed": seed}


def has_data(data_section: Any) -> bool:
    """Whether the recipe names training data: data.path or data.mixture."""
    return data_section.path is not None or bool(getattr(data_section, "mixture", None))


def source_name(path: Any) -> str:
    """The source to name in a message about the whole data: the path, or data.mixture (path None)."""
    return MIXTURE if path is None else str(path)


def load_records(path: str | Path, columns: Iterable[str], *, optional: Iterable[str] = (),
                 chat_columns: Iterable[str] = (), max_examples: int | None = None, keep: Iterable[str] = (),
                 keys: dict[str, str] | None = None, **source) -> list[dict]:
    """Rows of `path` restricted to `columns` (required) and `optional` ones, validated.

    Required columns must exist in the data and hold non-empty strings; a column listed in
    `chat_columns` may instead hold a list of {"role", "content"} messages. `source`: the
    `read_records` keywords (`source_options`); with a mixture `path` is None. `keep`: columns copied
    as they are (a non-string value, e.g. KTO's bool label), for the caller to validate. `keys`: the config
    key naming each column (`column_keys`), for the fix a missing column's message proposes."""
    columns, optional, chat = list(columns), list(optional), set(chat_columns)
    rows = read_records(path, **source)
    if not rows:
        raise DataError(f"{source_name(path)}: no examples (the file is empty)")
    present = sorted({k for r in rows[:1000] for k in r if k != "_line"})
    for col in columns:
        if col not in present:
            raise missing_column(where(path, rows[0]), col, present, (keys or {}).get(col))
    out = []
    for row in rows[:max_examples] if max_examples else rows:
        here = where(path, row)
        rec = {"_line": row["_line"]}
        for col in columns + [c for c in optional if c in row]:
            value = row.get(col)
            if col in chat and isinstance(value, list):
                check_messages(value, here, col)
            elif not isinstance(value, str):
                got = "missing" if value is None else type(value).__name__
                raise DataError(f"{here}: column '{col}' must be a string, got {got}")
            elif col in columns and not value.strip():
                raise DataError(f"{here}: column '{col}' is empty")
            rec[col] = value
        rec.update({k: row.get(k) for k in keep})
        out.append(rec)
    return out


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
    """'file:line' for messages about one record; a mixture's row (path None) carries its whole
    location (`a.jsonl:12`) in `_line`."""
    line = row.get("_line")
    if path is None:
        return str(line)
    return f"{path}:{line}" if isinstance(line, int) else f"{path} ({line})"


def split_eval(records: list, fraction: float, seed: int) -> tuple[list, list]:
    """Hold out `fraction` of the records (at least one when fraction > 0) with a seeded shuffle."""
    if fraction <= 0:
        return records, []
    n_eval = max(1, int(math.floor(len(records) * fraction)))
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    return [records[i] for i in order[n_eval:]], [records[i] for i in order[:n_eval]]

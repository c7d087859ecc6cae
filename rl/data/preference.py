"""Preference data for DPO and reward models: pairs from a file, validated, tokenised, and batched.

Files: `{"prompt", "chosen", "rejected"[, margin]}` rows (`load_preference_pairs`, `load_pairs`;
`load_pair_records` adds the eval rows: data.eval_path, else a seeded data.eval_fraction split).
`PreferenceDataset` tokenises them the way TRL does: the prompt alone and prompt + answer are tokenised and the
answer starts where the two token lists diverge; a too-long prompt keeps its last tokens, then answers are cut to
fit `max_length`, and message-list rows are rendered with the chat template.

Batches: `collate_pairs` puts B pairs into one concatenated batch of 2B rows [chosen..., rejected...],
padded to this batch's longest row, labels -100 on prompt and padding (so a sequence log-prob sums
over answer tokens only, whatever the padding), position ids counted over real tokens; `pack_pairs`
packs the same 2B sequences padding-free. `shard_batches` gives each process its share of the data in
micro-batches of one size on every rank (padding with weight-0 rows). The reward model's texts are
`encode_texts` (prompt + answer + EOS, too-long texts keeping their end), `pad_batch` and `pair_batch`
/ `stack_pair` (the two sides of a pair as one batch).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from rl.data.columns import column_keys, missing_column
from rl.data.records import (
    load_records,
    read_records,
    source_name,
    source_options,
    split_eval,
    where,
)
from rl.engine import losses
from rl.engine.packing import pack_prompt_groups, pack_sequences
from rl.errors import DataError

logger = logging.getLogger(__name__)


def encode_texts(tokenizer, texts: Sequence[str], max_length: int, append_eos: bool = True) -> list[list[int]]:
    """Token ids per text (+ EOS), keeping the last `max_length` tokens when too long."""
    enc = tokenizer(list(texts), add_special_tokens=True, truncation=False)["input_ids"]
    eos = tokenizer.eos_token_id
    out = []
    for ids in enc:
        ids = list(ids)
        if append_eos and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        out.append(ids[-max_length:])
    return out


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and 0/1 mask from lists of ids."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(list(s), dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


def stack_pair(ids_a, mask_a, ids_b, mask_b, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate two (B, Ta) / (B, Tb) batches along the batch, right-padding the shorter."""
    if mask_a is None:
        mask_a = torch.ones_like(ids_a)
    if mask_b is None:
        mask_b = torch.ones_like(ids_b)
    if ids_a.dim() == 1:  # a single unbatched pair
        ids_a, mask_a, ids_b, mask_b = (t.unsqueeze(0) for t in (ids_a, mask_a, ids_b, mask_b))
    if ids_a.shape[0] != ids_b.shape[0]:
        raise ValueError(f"A and B must have the same batch size, got {ids_a.shape[0]} and {ids_b.shape[0]}")
    T = max(ids_a.shape[1], ids_b.shape[1])

    def pad(t, value):
        return F.pad(t, (0, T - t.shape[1]), value=value)

    return (torch.cat([pad(ids_a, pad_id), pad(ids_b.to(ids_a.device), pad_id)]),
            torch.cat([pad(mask_a, 0), pad(mask_b.to(mask_a.device), 0)]))


@dataclass
class EncodedPairs:
    """Token ids of preference pairs (chosen and rejected texts, prompts already prepended)."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    margin: list[float] | None

    def __len__(self):
        return len(self.chosen)

    def take(self, idx: Sequence[int]) -> "EncodedPairs":
        return EncodedPairs([self.chosen[i] for i in idx], [self.rejected[i] for i in idx],
                            [self.margin[i] for i in idx] if self.margin is not None else None)


def encode_pairs(encode, chosen, rejected, prompts=None, margins=None) -> EncodedPairs:
    """`encode(texts) -> ids` applied to `prompt + chosen` and `prompt + rejected`; lengths checked."""
    chosen, rejected = list(chosen), list(rejected)
    if len(chosen) != len(rejected):
        raise ValueError(f"chosen_texts has {len(chosen)} texts but rejected_texts has {len(rejected)}")
    if prompts is not None:
        prompts = list(prompts)
        if len(prompts) != len(chosen):
            raise ValueError(f"prompts has {len(prompts)} entries but there are {len(chosen)} pairs")
        chosen = [p + c for p, c in zip(prompts, chosen)]
        rejected = [p + r for p, r in zip(prompts, rejected)]
    if margins is not None:
        margins = [float(m) for m in margins]
        if len(margins) != len(chosen):
            raise ValueError(f"margins has {len(margins)} entries but there are {len(chosen)} pairs")
    return EncodedPairs(encode(chosen), encode(rejected), margins)


def pair_batch(pairs: EncodedPairs, idx: Sequence[int], pad_id: int, side: str = "right"):
    """(2B, T) ids and mask, rows [0, B) chosen and [B, 2B) rejected, and the (B,) margins or None."""
    part = pairs.take(idx)
    ids, mask = pad_batch(part.chosen + part.rejected, pad_id, side=side)
    margin = torch.tensor(part.margin, dtype=torch.float32) if part.margin is not None else None
    return ids, mask, margin


@dataclass
class PreferencePairs:
    """Texts of a preference file: prompts (None when the file has no prompt column), answers, margins."""

    prompts: list[str] | None
    chosen: list[str]
    rejected: list[str]
    margins: list[float] | None

    def __len__(self):
        return len(self.chosen)


def load_preference_pairs(path: str | Path, prompt_column: str = "prompt", chosen_column: str = "chosen",
                          rejected_column: str = "rejected", margin_column: str | None = None,
                          max_examples: int | None = None, max_report: int = 5, **source) -> PreferencePairs:
    """`{"prompt", "chosen", "rejected"[, margin]}` rows of a JSONL/JSON/CSV/Parquet file, validated.

    The prompt column is optional for the whole file (absent everywhere: no prompts). Every bad row
    (missing or non-string field, empty text, chosen identical to rejected, non-numeric margin) is
    collected and reported together with its line number in one DataError. `source`: the
    `read_records` keywords (rl.data.records.source_options: config, split, streaming, mixture with path None)."""
    rows = read_records(path, **source)
    if max_examples:
        rows = rows[:max_examples]
    if not rows:
        raise DataError(f"{source_name(path)}: no examples (the file is empty)")
    present = {k for r in rows[:1000] for k in r if k != "_line"}
    for col, key in ((chosen_column, "data.chosen_column"), (rejected_column, "data.rejected_column")):
        if col not in present:  # a whole column, not a row, is missing: say which key maps it
            raise missing_column(where(path, rows[0]), col, present, key)
    has_prompt = any(prompt_column in r for r in rows)
    text_cols = ([prompt_column] if has_prompt else []) + [chosen_column, rejected_column]
    problems: list[str] = []
    prompts, chosen, rejected, margins = [], [], [], []
    for row in rows:
        here = where(path, row)
        bad = []
        for col in text_cols:
            v = row.get(col)
            if v is None:
                bad.append(f"missing field '{col}'")
            elif not isinstance(v, str):
                bad.append(f"field '{col}' must be a string, got {type(v).__name__}")
            elif col != prompt_column and not v.strip():
                bad.append(f"field '{col}' is empty")
        if not bad and row[chosen_column] == row[rejected_column]:
            bad.append(f"'{chosen_column}' and '{rejected_column}' are identical (no preference to learn)")
        m = 0.0
        if margin_column is not None:
            try:
                m = float(row[margin_column])
                if not math.isfinite(m):
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                bad.append(f"field '{margin_column}' must be a finite number, got {row.get(margin_column)!r}")
        if bad:
            problems.append(f"{here}: {'; '.join(bad)}")
            continue
        if has_prompt:
            prompts.append(row[prompt_column])
        chosen.append(row[chosen_column])
        rejected.append(row[rejected_column])
        margins.append(m)
    if problems:
        more = f" (and {len(problems) - max_report} more bad rows)" if len(problems) > max_report else ""
        raise DataError(f"{len(problems)} bad preference rows; fix or remove them: "
                        + " | ".join(problems[:max_report]) + more)
    return PreferencePairs(prompts if has_prompt else None, chosen, rejected,
                           margins if margin_column is not None else None)


def load_pairs(path, cfg, for_eval: bool = False) -> list[dict]:
    """Validated preference rows; a bad row fails with its file and line. `for_eval`: path is
    data.eval_path (its split is data.eval_split)."""
    d = cfg.data
    cols = [d.prompt_column, d.chosen_column, d.rejected_column]
    records = load_records(path, cols, chat_columns=cols, max_examples=d.max_examples, keys=column_keys(d),
                           **source_options(d, for_eval, seed=cfg.seed))
    for r in records:
        if r[d.chosen_column] == r[d.rejected_column]:
            raise DataError(f"{where(path, r)}: chosen and rejected are identical; such a pair teaches nothing")
    return records


def load_pair_records(cfg) -> tuple[list[dict], list[dict] | None]:
    """The recipe's training rows and eval rows: data.eval_path, else a seeded data.eval_fraction split."""
    records = load_pairs(cfg.data.path, cfg)
    if cfg.data.eval_path:
        return records, load_pairs(cfg.data.eval_path, cfg, for_eval=True)
    return split_eval(records, cfg.data.eval_fraction, cfg.seed)


class PreferenceDataset(torch.utils.data.Dataset):
    """Tokenised preference pairs: per-example prompt ids and chosen/rejected answer ids.

    Prompts longer than `max_prompt_length` keep their LAST tokens (the part next to the answer); answers
    are then cut (keeping their start) so that prompt + answer fits `max_length`. How many of each were
    cut is logged and kept in `.truncation`. Prompts/answers given as message lists ({"role", "content"})
    are rendered with the tokenizer's chat template, as are strings when `chat_template=True`.

    Tokenisation follows TRL: the prompt alone and prompt+answer are tokenised, and the answer starts
    where the two token lists diverge (tokens can merge across the boundary, and some chat templates
    render a prompt differently when an answer follows).
    """

    def __init__(self, prompts: Sequence, chosen: Sequence, rejected: Sequence, tokenizer, max_length: int = 512,
                 max_prompt_length: int = 256, chat_template: bool = False, add_eos: bool = True,
                 sources: Sequence[str] | None = None):
        if not (len(prompts) == len(chosen) == len(rejected)):
            raise ValueError(f"prompts, chosen and rejected must have the same length, got "
                             f"{len(prompts)}, {len(chosen)}, {len(rejected)}")
        if max_prompt_length >= max_length:
            raise ValueError(f"max_prompt_length={max_prompt_length} must be below max_length={max_length}")
        self.max_length, self.max_prompt_length = max_length, max_prompt_length
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.examples: list[dict] = []
        self.truncation = {"pairs": len(prompts), "prompts_truncated": 0, "answers_truncated": 0}
        self.ref_logps: torch.Tensor | None = None  # (N, 2) chosen/rejected, set by precomputation
        for i, (p, c, r) in enumerate(zip(prompts, chosen, rejected)):
            where = sources[i] if sources else f"pair {i}"
            p_ids, c_ids, r_ids = _tokenize_pair(tokenizer, p, c, r, chat_template, add_eos)
            if not c_ids or not r_ids:
                raise ValueError(f"{where}: the chosen or rejected answer is empty after tokenisation")
            if len(p_ids) > max_prompt_length:
                p_ids = p_ids[-max_prompt_length:]
                self.truncation["prompts_truncated"] += 1
            room = max_length - len(p_ids)
            if len(c_ids) > room or len(r_ids) > room:
                c_ids, r_ids = c_ids[:room], r_ids[:room]
                self.truncation["answers_truncated"] += 1
            self.examples.append({"prompt_ids": p_ids, "chosen_ids": c_ids, "rejected_ids": r_ids})
        t = self.truncation
        if t["prompts_truncated"] or t["answers_truncated"]:
            logger.warning("preference data: %d of %d prompts cut to their last max_prompt_length=%d tokens; "
                           "%d pairs had answers cut to fit max_length=%d", t["prompts_truncated"], t["pairs"],
                           max_prompt_length, t["answers_truncated"], max_length)

    @classmethod
    def from_records(cls, records: list[dict], tokenizer, cfg, source: str = "data"):
        """Rows with prompt/chosen/rejected columns (names from cfg.data) -> dataset."""
        d = cfg.data
        srcs = [where(source, r) if "_line" in r else f"{source} row {i}" for i, r in enumerate(records)]
        return cls([r[d.prompt_column] for r in records], [r[d.chosen_column] for r in records],
                   [r[d.rejected_column] for r in records], tokenizer, cfg.max_length, cfg.max_prompt_length,
                   chat_template=cfg.chat_template, add_eos=cfg.append_eos, sources=srcs)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        ex = dict(self.examples[i])
        if self.ref_logps is not None:
            ex["ref_chosen_logps"], ex["ref_rejected_logps"] = self.ref_logps[i].tolist()
        return ex


def _as_messages(x, role: str) -> list[dict]:
    return x if isinstance(x, list) else [{"role": role, "content": x}]


def _tokenize_pair(tokenizer, prompt, chosen, rejected, chat_template: bool, add_eos: bool):
    """-> (prompt_ids, chosen_ids, rejected_ids) as lists of ints."""
    chat = chat_template or any(isinstance(x, list) for x in (prompt, chosen, rejected))
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat-format preference data needs a tokenizer with a chat template")
        pm = _as_messages(prompt, "user")

        def enc(msgs, gen):
            out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=True)
            return list(out["input_ids"])

        p_ids = enc(pm, True)
        pc_ids = enc(pm + _as_messages(chosen, "assistant"), False)
        pr_ids = enc(pm + _as_messages(rejected, "assistant"), False)
    else:
        eos = tokenizer.eos_token or ""
        if add_eos:
            chosen = chosen if chosen.endswith(eos) else chosen + eos
            rejected = rejected if rejected.endswith(eos) else rejected + eos
        p_ids = list(tokenizer(prompt)["input_ids"])
        pc_ids = list(tokenizer(prompt + chosen)["input_ids"])
        pr_ids = list(tokenizer(prompt + rejected)["input_ids"])
    n = min(_common_prefix(p_ids, pc_ids), _common_prefix(p_ids, pr_ids))
    return p_ids[:n], pc_ids[n:], pr_ids[n:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def collate_pairs(examples: list[dict], pad_token_id: int, padding_side: str = "right") -> dict[str, torch.Tensor]:
    """B pairs -> one concatenated batch of 2B sequences [chosen..., rejected...].

    Padded to the longest sequence of THIS batch (no padding to max_length). Returns input_ids,
    attention_mask, labels (-100 on prompt and padding), position_ids (count only real tokens, so left
    padding gives the same positions as right padding), all (2B, T), and ref_*_logps (B,) when present.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    seqs = [(e["prompt_ids"], e["chosen_ids"]) for e in examples] + \
           [(e["prompt_ids"], e["rejected_ids"]) for e in examples]
    width = max(len(p) + len(a) for p, a in seqs)
    n = len(seqs)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    labels = torch.full((n, width), losses.IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, (p, a) in enumerate(seqs):
        length = len(p) + len(a)
        start = 0 if padding_side == "right" else width - length
        ids[i, start:start + length] = torch.tensor(p + a, dtype=torch.long)
        labels[i, start + len(p):start + length] = torch.tensor(a, dtype=torch.long)
        mask[i, start:start + length] = 1
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels,
           "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    if "ref_chosen_logps" in examples[0]:
        out["ref_chosen_logps"] = torch.tensor([e["ref_chosen_logps"] for e in examples], dtype=torch.float32)
        out["ref_rejected_logps"] = torch.tensor([e["ref_rejected_logps"] for e in examples], dtype=torch.float32)
    return out


def pack_pairs(examples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """B pairs -> the 2B sequences [chosen..., rejected...] of `collate_pairs`, packed padding-free
    (`rl.engine.packing.pack_sequences`): input_ids, labels (-100 on prompts), position_ids and sequence_index
    (0..2B-1 in that order, -1 on row padding), each (R, W) with R <= 2B, no attention_mask (the model
    separates the sequences by their position ids), and ref_*_logps (B,) when present."""
    seqs = [(e["prompt_ids"] + e[key], [losses.IGNORE_INDEX] * len(e["prompt_ids"]) + e[key])
            for key in ("chosen_ids", "rejected_ids") for e in examples]
    out = pack_sequences(seqs, pad_token_id)
    if "ref_chosen_logps" in examples[0]:
        out["ref_chosen_logps"] = torch.tensor([e["ref_chosen_logps"] for e in examples], dtype=torch.float32)
        out["ref_rejected_logps"] = torch.tensor([e["ref_rejected_logps"] for e in examples], dtype=torch.float32)
    return out


def pack_pairs_shared(examples: list[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """B pairs -> one packed row where each pair's prompt is computed once for both answers
    (`rl.engine.packing.pack_prompt_groups`): input_ids, labels (-100 on prompts), position_ids and
    sequence_index (0..B-1 the chosen answers, B..2B-1 the rejected, as `pack_pairs`; -1 on prompt
    prefixes), each (1, W), plus `cu_seq_lens` and `prefix_of` (the model inputs of
    `rl.engine.segments.shared_prefix_inputs`) and ref_*_logps (B,) when present. No padding at all, so
    `pad_token_id` is unused (it keeps `collate_pairs`' signature)."""
    out = pack_prompt_groups([(e["prompt_ids"], [(e["chosen_ids"], e["chosen_ids"]), (e["rejected_ids"], e["rejected_ids"])])
                              for e in examples])
    out.pop("starts")
    seq, B = out["sequence_index"], len(examples)
    # group order is chosen_0, rejected_0, chosen_1, ...: number them [chosen..., rejected...]
    out["sequence_index"] = torch.where(seq >= 0, (seq % 2) * B + seq // 2, seq)
    if "ref_chosen_logps" in examples[0]:
        out["ref_chosen_logps"] = torch.tensor([e["ref_chosen_logps"] for e in examples], dtype=torch.float32)
        out["ref_rejected_logps"] = torch.tensor([e["ref_rejected_logps"] for e in examples], dtype=torch.float32)
    return out


def shard_batches(n: int, batch_size: int, world: int, rank: int):
    """Yield (indices, weights) micro-batches of this rank's share of range(n); every rank gets the same
    number of batches of the same size, padding with index 0 at weight 0."""
    per_rank = math.ceil(n / world)
    per_rank = math.ceil(per_rank / batch_size) * batch_size
    idx = list(range(n)) + [0] * (per_rank * world - n)
    w = [1.0] * n + [0.0] * (per_rank * world - n)
    mine, wmine = idx[rank * per_rank:(rank + 1) * per_rank], w[rank * per_rank:(rank + 1) * per_rank]
    for s in range(0, per_rank, batch_size):
        yield mine[s:s + batch_size], torch.tensor(wmine[s:s + batch_size])

"""Unpaired preference data (KTO): rows {"prompt", "completion", "label": true|false}, column names under
data.* (prompt_column, completion_column, label_column); strings or chat message lists.

Tokenisation is the pairs' (`rl.data.preference`, TRL's rule: the completion starts where the tokenised
prompt and prompt+completion diverge; EOS appended to plain text). `collate_unpaired` builds a micro-batch
and, for KTO's reference point, its mismatched (prompt, completion) rows: the completions rotated by one
within the micro-batch, (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}), as TRL 1.16's KTOTrainer does per batch.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from rl.data.preference import _tokenize_pair, pad_batch
from rl.data.columns import column_keys, missing_column
from rl.data.records import load_records, read_records, source_options, split_eval, where
from rl.errors import DataError

logger = logging.getLogger(__name__)


def load_unpaired(path, cfg, for_eval: bool = False) -> list[dict]:
    """Validated KTO rows; a bad row (a label that is not true/false) fails with its file and line."""
    d = cfg.data
    cols = [d.prompt_column, d.completion_column]
    records = load_records(path, cols, chat_columns=cols, max_examples=d.max_examples, keep=[d.label_column],
                           keys=column_keys(d), **source_options(d, for_eval, seed=cfg.seed))
    if records and all(r[d.label_column] is None for r in records[:1000]):  # no such column at all
        present = {k for r in read_records(path, **source_options(d, for_eval, seed=cfg.seed))[:1] for k in r} - {"_line"}
        raise missing_column(where(path, records[0]), d.label_column, present, "data.label_column")
    for r in records:
        label = r[d.label_column]
        if not isinstance(label, bool):
            got = "missing" if label is None else f"{type(label).__name__} {label!r}"
            raise DataError(f"{where(path, r)}: column '{d.label_column}' must be true or false, got {got}")
    return records


def load_unpaired_records(cfg) -> tuple[list[dict], list[dict] | None]:
    """The recipe's training rows and eval rows: data.eval_path, else a seeded data.eval_fraction split.
    Training data with only one kind of label fails: KTO needs desirable and undesirable examples."""
    records = load_unpaired(cfg.data.path, cfg)
    labels = {r[cfg.data.label_column] for r in records}
    if labels != {True, False}:
        raise DataError(f"{cfg.data.path}: every label is {labels.pop()}; KTO needs both desirable (true) and "
                        f"undesirable (false) completions")
    if cfg.data.eval_path:
        return records, load_unpaired(cfg.data.eval_path, cfg, for_eval=True)
    return split_eval(records, cfg.data.eval_fraction, cfg.seed)


class UnpairedDataset(torch.utils.data.Dataset):
    """Tokenised KTO rows: prompt ids, completion ids and the label. Prompts longer than
    `max_prompt_length` keep their last tokens; completions are cut (keeping their start) to fit
    `max_length`; both counts are logged and kept in `.truncation`."""

    def __init__(self, prompts: Sequence, completions: Sequence, labels: Sequence[bool], tokenizer,
                 max_length: int = 512, max_prompt_length: int = 256, chat_template: bool = False,
                 add_eos: bool = True, sources: Sequence[str] | None = None):
        if not (len(prompts) == len(completions) == len(labels)):
            raise ValueError(f"prompts, completions and labels must have the same length, got "
                             f"{len(prompts)}, {len(completions)}, {len(labels)}")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.examples: list[dict] = []
        self.truncation = {"rows": len(prompts), "prompts_truncated": 0, "completions_truncated": 0}
        for i, (p, c, lab) in enumerate(zip(prompts, completions, labels)):
            p_ids, c_ids, _ = _tokenize_pair(tokenizer, p, c, c, chat_template, add_eos)
            if not c_ids:
                raise ValueError(f"{sources[i] if sources else f'row {i}'}: the completion is empty after tokenisation")
            if len(p_ids) > max_prompt_length:
                p_ids = p_ids[-max_prompt_length:]
                self.truncation["prompts_truncated"] += 1
            if len(c_ids) > max_length - len(p_ids):
                c_ids = c_ids[:max_length - len(p_ids)]
                self.truncation["completions_truncated"] += 1
            self.examples.append({"prompt_ids": p_ids, "completion_ids": c_ids, "label": bool(lab)})
        t = self.truncation
        if t["prompts_truncated"] or t["completions_truncated"]:
            logger.warning("kto data: %d of %d prompts cut to max_prompt_length=%d tokens, %d completions cut to "
                           "fit max_length=%d", t["prompts_truncated"], t["rows"], max_prompt_length,
                           t["completions_truncated"], max_length)

    @classmethod
    def from_records(cls, records: list[dict], tokenizer, cfg, source: str = "data"):
        d = cfg.data
        srcs = [where(source, r) if "_line" in r else f"{source} row {i}" for i, r in enumerate(records)]
        return cls([r[d.prompt_column] for r in records], [r[d.completion_column] for r in records],
                   [r[d.label_column] for r in records], tokenizer, cfg.max_length, cfg.max_prompt_length,
                   chat_template=cfg.chat_template, add_eos=cfg.append_eos, sources=srcs)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        return self.examples[i]


def _rows(prompts: list[list[int]], completions: list[list[int]], pad_id: int, prefix: str = ""):
    seqs = [p + c for p, c in zip(prompts, completions)]
    ids, mask = pad_batch(seqs, pad_id)
    labels = ids.masked_fill(mask == 0, -100)
    for i, p in enumerate(prompts):
        labels[i, :len(p)] = -100
    return {f"{prefix}input_ids": ids, f"{prefix}attention_mask": mask, f"{prefix}labels": labels}


def collate_unpaired(examples: list[dict], pad_token_id: int, kl: bool = True) -> dict[str, torch.Tensor]:
    """B rows -> right-padded input_ids, attention_mask, labels (-100 on prompt and padding), label (B,)
    bool; with `kl` also kl_input_ids, kl_attention_mask, kl_labels of the mismatched rows (prompt i with
    completion i-1, cyclically; one row is its own match, so KTO wants B >= 2)."""
    prompts = [e["prompt_ids"] for e in examples]
    comps = [e["completion_ids"] for e in examples]
    out = _rows(prompts, comps, pad_token_id)
    out["label"] = torch.tensor([e["label"] for e in examples], dtype=torch.bool)
    if kl:
        out.update(_rows(prompts, comps[-1:] + comps[:-1], pad_token_id, prefix="kl_"))
    return out

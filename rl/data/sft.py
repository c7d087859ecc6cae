"""Supervised fine-tuning data: rows to token ids and labels, micro-batches, and the token count that
normalises the loss.

Data (`load_sft_records` picks the format from the columns present): `text` rows, `prompt`/`completion`
rows, or chat `messages` rows (rendered with the tokenizer's chat template; the last assistant message
is the completion). `tokenize_examples` sets labels to -100 on the prompt with completion-only loss,
so the objective is -sum_t log p(x_t | x_<t) over the answer tokens (or over all tokens). Too-long
examples are truncated or, when strict, rejected, and counted in a LengthReport.

`collate` right-pads a micro-batch to its own longest example. `counted_tokens` is the number of
tokens that carry loss (labels after the shift); the trainer divides by its sum over the whole
optimizer step (all micro-batches, all processes), which is what makes N micro-batches, or N
processes, give exactly the gradient of one big batch (a per-micro-batch mean would weight short
examples more).
"""

from __future__ import annotations

import logging

import torch

from rl.data.chat import render_chat, with_bos
from rl.data.columns import COLUMN_SYNONYMS, column_keys
from rl.data.records import (
    LengthReport,
    load_records,
    read_records,
    source_options,
    where,
)
from rl.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- data

def tokenize_examples(records: list[dict], tokenizer, cfg, source: str = "data") -> list[dict]:
    """Records -> [{"input_ids": [...], "labels": [...]}]; labels are -100 on prompt tokens when
    completion_only_loss says so (null: prompt/completion rows, as TRL). Examples longer than max_length are
    truncated (or rejected)."""
    d = cfg.data
    report = LengthReport(cfg.max_length, d.strict)
    eos = [tokenizer.eos_token_id] if cfg.append_eos and tokenizer.eos_token_id is not None else []
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "bos_token_id", None) is not None else []
    out = []
    for row in records:
        chat = d.messages_column in row and isinstance(row[d.messages_column], list)
        if chat:
            msgs = row[d.messages_column]
            if not msgs or msgs[-1]["role"] != "assistant":
                raise ConfigError(f"{where(source, row)}: the last message must be the assistant's answer")
            prompt = render_chat(tokenizer, msgs[:-1], add_generation_prompt=True)
            completion = msgs[-1]["content"]
        elif d.prompt_column in row and d.completion_column in row:
            prompt, completion = row[d.prompt_column], row[d.completion_column]
        else:
            prompt, completion = "", row[d.text_column]
        p_ids = with_bos(tokenizer, tokenizer(prompt, add_special_tokens=False)["input_ids"]) if prompt else list(bos)
        c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + eos
        ids = report.fit(p_ids + c_ids, where(source, row))
        n_prompt = min(len(p_ids), len(ids))
        only = cfg.completion_only_loss
        masked = (not chat if only is None else only) and bool(prompt)  # None: TRL's meaning
        labels = [-100] * n_prompt + ids[n_prompt:] if masked else list(ids)
        if masked and all(x == -100 for x in labels):
            raise ConfigError(f"{where(source, row)}: nothing of the completion fits max_length="
                              f"{cfg.max_length}; raise max_length")
        out.append({"input_ids": ids, "labels": labels})
    report.log("SFT examples")
    return out


def load_sft_records(path, cfg, for_eval: bool = False) -> list[dict]:
    """Pick the data format from the columns present: messages, prompt/completion or text.
    `for_eval`: `path` is data.eval_path (read its data.eval_split)."""
    d = cfg.data
    source = source_options(d, for_eval, seed=cfg.seed)
    first = read_records(path, **source)[:1]
    cols = set(first[0]) if first else set()
    if d.messages_column in cols:
        spec = dict(columns=[d.messages_column], chat_columns=[d.messages_column])
    elif d.prompt_column in cols and d.completion_column in cols:
        spec = dict(columns=[d.prompt_column, d.completion_column])
    elif d.text_column in cols or not first:
        spec = dict(columns=[d.text_column])
    else:  # none of the three formats: name the keys that map each
        prompt = next((c for c in COLUMN_SYNONYMS["prompt_column"] if c in cols), None)
        answer = next((c for c in COLUMN_SYNONYMS["completion_column"] if c in cols and c != prompt), None)
        fix = (f"set data.prompt_column={prompt} data.completion_column={answer} if those hold them" if prompt
               and answer else "set data.text_column, data.prompt_column and data.completion_column, or "
               "data.messages_column to the columns that hold them")
        raise DataError(f"{where(path, first[0])}: no '{d.text_column}' column, no '{d.prompt_column}'/"
                        f"'{d.completion_column}' pair and no '{d.messages_column}' column (columns present: "
                        f"{', '.join(sorted(cols - {'_line'}))}); {fix}, or rename the columns in the data")
    records = load_records(path, max_examples=d.max_examples, keys=column_keys(d), **spec, **source)
    for row in records:
        msgs = row.get(d.messages_column)
        if msgs is not None and not isinstance(msgs, list):  # a string here is not chat data
            raise DataError(f"{where(path, row)}: column '{d.messages_column}' must be a list of "
                            f"{{\"role\", \"content\"}} messages, got {type(msgs).__name__}; put plain text in "
                            f"a '{d.text_column}' column (or set data.messages_column)")
    return records


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch to its own longest example (no padding to max_length)."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def counted_tokens(examples: list[dict]) -> int:
    """Tokens that carry loss (labels after the shift: position 0 never does)."""
    return sum(sum(1 for x in e["labels"][1:] if x != -100) for e in examples)

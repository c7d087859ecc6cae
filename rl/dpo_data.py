"""DPO data: preference pairs from a file, tokenised (TRL's prompt/answer split), collated into one
concatenated batch [chosen..., rejected...] and sharded across processes, and the per-sequence
answer log-probs of such a batch (prompt and padding never count)."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Sequence

import torch

from rl import losses
from rl.chunked import auto_chunk_size, capture_head, head_vocab, output_head
from rl.data import DataError, load_records, source_options, where
from rl.generation import _unwrap, sequence_logprobs
from rl.packing import pack_sequences, segment_sum
from rl.sft import split_eval

if TYPE_CHECKING:  # annotations only: rl.dpo imports this module
    from rl.dpo import DPOConfig

logger = logging.getLogger(__name__)


def load_pairs(path, cfg: DPOConfig, for_eval: bool = False) -> list[dict]:
    """Validated preference rows; a bad row fails with its file and line. `for_eval`: path is
    data.eval_path (its split is data.eval_split)."""
    d = cfg.data
    cols = [d.prompt_column, d.chosen_column, d.rejected_column]
    records = load_records(path, cols, chat_columns=cols, max_examples=d.max_examples,
                           **source_options(d, for_eval, seed=cfg.seed))
    for r in records:
        if r[d.chosen_column] == r[d.rejected_column]:
            raise DataError(f"{where(path, r)}: chosen and rejected are identical; such a pair teaches nothing")
    return records


def load_pair_records(cfg: DPOConfig) -> tuple[list[dict], list[dict] | None]:
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
    def from_records(cls, records: list[dict], tokenizer, cfg: "DPOConfig", source: str = "data"):
        """Rows with prompt/chosen/rejected columns (names from cfg.data) -> dataset."""
        d = cfg.data
        srcs = [where(source, r) if "_line" in r else f"{source} row {i}" for i, r in enumerate(records)]
        return cls([r[d.prompt_column] for r in records], [r[d.chosen_column] for r in records],
                   [r[d.rejected_column] for r in records], tokenizer, cfg.max_length, cfg.max_prompt_length,
                   chat_template=cfg.chat_template, add_eos=cfg.add_eos, sources=srcs)

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
    (`rl.packing.pack_sequences`): input_ids, labels (-100 on prompts), position_ids and sequence_index
    (0..2B-1 in that order, -1 on row padding), each (R, W) with R <= 2B, no attention_mask (the model
    separates the sequences by their position ids), and ref_*_logps (B,) when present."""
    seqs = [(e["prompt_ids"] + e[key], [losses.IGNORE_INDEX] * len(e["prompt_ids"]) + e[key])
            for key in ("chosen_ids", "rejected_ids") for e in examples]
    out = pack_sequences(seqs, pad_token_id)
    if "ref_chosen_logps" in examples[0]:
        out["ref_chosen_logps"] = torch.tensor([e["ref_chosen_logps"] for e in examples], dtype=torch.float32)
        out["ref_rejected_logps"] = torch.tensor([e["ref_rejected_logps"] for e in examples], dtype=torch.float32)
    return out


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, sequence_index: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of answer-token log-probs and number of answer tokens per sequence.

    logits (N, T, V), labels (N, T) with -100 on prompt and padding (HF convention, shifted inside).
    Returns (logps (N,), lengths (N,)) in fp32. Packed rows (`pack_pairs`) give `sequence_index`
    (R, T): the sums then run over each sequence's tokens, wherever its rows put them, (S,) for the S
    sequences (S = max index + 1).
    """
    logp, mask = losses.token_logprobs(logits, labels)
    if sequence_index is None:
        return logp.sum(-1), mask.sum(-1)
    # the target at position t+1 is predicted at t and belongs to the sequence of token t+1
    target_seq = sequence_index[:, 1:].to(logp.device)
    n = int(sequence_index.max()) + 1
    return segment_sum(logp, target_seq, n), segment_sum(mask, target_seq, n)


@torch.no_grad()
def concatenated_logps(model, batch: dict[str, torch.Tensor], chunk_size: int | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """No-grad forward of a collated batch -> (chosen_logps, rejected_logps, chosen_lengths,
    rejected_lengths), each (B,). Passes position_ids, so it is exact for either padding side. The LM
    head runs over `chunk_size` positions at a time (automatically when the logits would be large;
    see `rl.generation.sequence_logprobs`), so no (2B, T, V) logits."""
    device = next(iter(batch.values())).device
    if "sequence_index" in batch:  # packed rows (pack_pairs)
        logps, lengths = _packed_logps(model, {k: v.to(device) for k, v in batch.items()}, chunk_size)
    else:
        ids, mask, pos = (batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids"))
        labels = batch["labels"].to(device)
        logp, m = sequence_logprobs(model, ids, mask, labels, chunk_size=chunk_size, position_ids=pos)
        logps, lengths = logp.sum(-1), m.sum(-1)
    c, r = logps.chunk(2)
    cl, rl = lengths.chunk(2)
    return c, r, cl, rl


def _packed_logps(model, batch: dict[str, torch.Tensor], chunk_size: int | None):
    """`sequence_logps` of packed rows under `model`, its LM head chunked as in
    `rl.generation.sequence_logprobs`: the forward gets position_ids, no mask and no cache (so
    transformers builds the block-diagonal mask, `rl.packing`)."""
    lm = _unwrap(model)
    ids = batch["input_ids"]
    head = output_head(lm)
    chunk = auto_chunk_size(ids.shape[0], ids.shape[1], head_vocab(head), chunk_size) if head is not None else None
    with capture_head(lm, chunk) if chunk else contextlib.nullcontext():
        logits = lm(input_ids=ids, position_ids=batch["position_ids"], use_cache=False).logits
    return sequence_logps(logits, batch["labels"], batch["sequence_index"])


def _shards(n: int, batch_size: int, world: int, rank: int):
    """Yield (indices, weights) micro-batches of this rank's share of range(n); every rank gets the same
    number of batches of the same size, padding with index 0 at weight 0."""
    per_rank = math.ceil(n / world)
    per_rank = math.ceil(per_rank / batch_size) * batch_size
    idx = list(range(n)) + [0] * (per_rank * world - n)
    w = [1.0] * n + [0.0] * (per_rank * world - n)
    mine, wmine = idx[rank * per_rank:(rank + 1) * per_rank], w[rank * per_rank:(rank + 1) * per_rank]
    for s in range(0, per_rank, batch_size):
        yield mine[s:s + batch_size], torch.tensor(wmine[s:s + batch_size])

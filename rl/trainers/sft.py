"""Supervised fine-tuning (SFT): next-token cross-entropy, optionally on the completion only.

Objective: minimise -sum_t log p(x_t | x_<t) over the answer tokens (completion-only) or all tokens,
normalised by the number of counted tokens in the whole optimizer step (all micro-batches, all
processes). That normalisation is what makes N micro-batches, or N processes, give exactly the
gradient of one big batch; a per-micro-batch mean would weight short examples more.

Data: `text` rows, `prompt`/`completion` rows, or chat `messages` rows (rendered with the
tokenizer's chat template; the last assistant message is the completion).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial

import torch

from rl.config.fields import opt
from rl.config.plan import epoch_plan
from rl.config.schema import TrainConfig
from rl.data.sft import collate, counted_tokens
from rl.engine import losses, segments
from rl.engine.chunked import HeadLogits, output_head
from rl.engine.fused_head import head_nll, plain_head
from rl.engine.packing import pack_common_prefix, pack_examples
from rl.trainers.epoch import EpochTrainer, split_even

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SFTConfig(TrainConfig):
    completion_only_loss: bool | None = opt(
        None, "count only completion tokens in the loss: true (prompt/completion data, or chat data's last assistant "
        "message), false (the whole text), null (TRL's default: the completion of prompt/completion data, the whole "
        "text of chat and text data)")
    append_eos: bool = opt(True, "append the EOS token to every example so the model learns to stop")
    packing: bool = opt(False, "padding-free micro-batches: each micro-batch's examples concatenated into one "
                        "row with per-example position_ids (rl.engine.packing); same loss, no compute on padding")
    share_prompt_forward: bool = opt(True, "with packing: the tokens every example of a micro-batch starts with and "
                                     "that carry no loss (a chat template's system prompt) are computed once, the "
                                     "examples attending to them (rl.engine.packing.pack_common_prefix; same loss; "
                                     "SDPA models)")


def sum_normalised_nll(logits, labels, attention_mask, scale: float):
    """Summed NLL times `scale` (= world * accumulation / tokens in the optimizer step), so that the
    engine's 1/accumulation and DDP's 1/world leave exactly sum / tokens.

    With the LM head deferred (`HeadLogits`, SFT's forwards ask for it) and a plain linear head, the
    head, the NLL and the accuracy are one pass over the counted positions (`rl.engine.fused_head`):
    the (B, T, V) logits never exist and the head's matmul is not recomputed in backward."""
    fused = head_nll(logits, labels) if isinstance(logits, HeadLogits) else None
    if fused is not None:
        nll_sum, correct = fused
        n = (labels[:, 1:] != -100).sum().clamp(min=1)
        return nll_sum * scale, {"nll": nll_sum.detach() / n, "correct": correct}
    logp, mask = losses.token_logprobs(logits, labels)
    nll_sum = -(logp * mask).sum()
    n = mask.sum().clamp(min=1)
    return nll_sum * scale, {"nll": nll_sum.detach() / n, "correct": correct_tokens(logits, labels)}


def _packed_nll(model, inputs, outputs, labels, scale: float):
    """`sum_normalised_nll` as a custom loss of `forward_backward_custom` (the packed forward with the
    sequences' boundaries as model inputs), with the counted tokens among the metrics."""
    labels = labels.to(inputs["input_ids"].device)
    loss, metrics = sum_normalised_nll(outputs.logits, labels, None, scale)
    return loss, {**metrics, "tokens": (labels[:, 1:] != -100).sum()}


def correct_tokens(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many counted label tokens (labels != -100, shifted as in the loss) are the argmax of the
    logits before them: logits (B, T, V), labels (B, T) -> a scalar. Divided by the counted tokens it
    is TRL's `mean_token_accuracy`."""
    target, pred = labels[:, 1:], logits[:, :-1].argmax(-1)
    return ((pred == target) & (target != -100)).sum().detach()


# ------------------------------------------------------------------------------------------ trainer

class SFTTrainer(EpochTrainer):
    """SFT on the shared lifecycle (rl.trainers.base): one `train_step` is one optimizer step."""

    def __init__(self, config: SFTConfig, *, model=None, tokenizer=None):
        self.build(config, model=model, tokenizer=tokenizer)

    def plan(self, n_examples: int) -> dict:
        """Derived sizes, computed once (see `rl.config.fields.epoch_plan`)."""
        return epoch_plan(self.cfg, n_examples, self.world)

    def train(self, train_examples: list[dict], eval_examples: list[dict] | None = None) -> list[dict]:
        cfg = self.cfg
        plan = self._plan = self.plan(len(train_examples))
        self.pipeline = self.build_pipeline(self._model, plan["total_steps"], cfg.per_device_train_batch_size)
        tracker = self.open_run(plan["total_steps"], desc="sft")
        self.announce(tracker, f"sft: {len(train_examples)} examples, {plan['total_steps']} steps, global batch "
                      f"{plan['global_batch']}")
        self._train, self._num_tokens = train_examples, 0
        # packed rows attend per example ("rl_segments", rl.engine.segments): SDPA on CPU would otherwise pay
        # for the whole row's (sum of lengths)^2 score matrix under the block-diagonal mask
        self._segments = cfg.packing and segments.enable(self.pipeline.unwrapped_model)
        self._share = self._segments and cfg.share_prompt_forward and segments.prefix_sharing(self.pipeline.unwrapped_model)
        # the LM head deferred to the loss only where the loss can fuse it (a plain linear head, not one ZeRO-3
        # partitions): otherwise small logits stay on the plain path, as before
        self._fuse = plain_head(output_head(self.pipeline.model))
        self.start_epochs(len(train_examples), eval_examples)
        return self.fit(plan["total_steps"], tracker)

    def train_step(self) -> dict:
        cfg, acc, pipe = self.cfg, self.accelerator, self.pipeline
        t0 = time.time()
        batch = [self._train[i] for i in self.next_global_batch()]
        scale = self.world * cfg.gradient_accumulation_steps / max(1, counted_tokens(batch))
        nll_sum, n_tok, correct = 0.0, 0, 0.0
        for micro in split_even(batch[acc.process_index::self.world], cfg.gradient_accumulation_steps):
            # a short last step can leave this process an empty micro-batch: it still runs one
            # forward/backward (ZeRO-3 needs every rank in every forward) on an example with no
            # counted token, so the step's loss stays sum / tokens of the real examples
            micro = micro or [{"input_ids": batch[0]["input_ids"], "labels": [-100] * len(batch[0]["labels"])}]
            if cfg.packing:  # one row, no mask: the model separates the examples by their position ids
                shared = pack_common_prefix(micro) if self._share else None
                b = shared or pack_examples(micro)
                if self._segments:
                    inputs = segments.shared_prefix_inputs(b) if shared else segments.model_inputs(b["position_ids"])
                    r = pipe.forward_backward_custom(partial(_packed_nll, labels=b["labels"], scale=scale),
                                                     b["input_ids"], None, model_inputs=inputs,
                                                     defer_head=self._fuse).result()
                    r.num_tokens = int(r.metrics.pop("tokens"))
                else:
                    r = pipe.forward_backward(b["input_ids"], None, b["labels"], position_ids=b["position_ids"],
                                              loss_fn=partial(sum_normalised_nll, scale=scale),
                                              defer_head=self._fuse).result()
            else:
                b = collate(micro, self.tokenizer.pad_token_id)
                r = pipe.forward_backward(b["input_ids"], b["attention_mask"], b["labels"],
                                          loss_fn=partial(sum_normalised_nll, scale=scale), defer_head=self._fuse).result()
            nll_sum += r.metrics["nll"] * r.num_tokens
            n_tok += r.num_tokens
            correct += r.metrics["correct"]
        o = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
        t = self.reduce({"nll": nll_sum, "tokens": n_tok, "correct": correct}, "sum")
        self._num_tokens += sum(len(ex["input_ids"]) for ex in batch)  # input tokens so far, as TRL counts them
        n = max(t["tokens"], 1)
        return {"step": pipe.step, "loss": t["nll"] / n, "grad_norm": o.grad_norm,
                "learning_rate": o.learning_rate, "epoch": self.epoch_progress, "num_tokens": self._num_tokens,
                "mean_token_accuracy": t["correct"] / n, "step_time": time.time() - t0}

    def checkpoint_extra(self) -> dict:
        return {**super().checkpoint_extra(), "num_tokens": self._num_tokens}

    def restore(self, extra: dict) -> None:
        super().restore(extra)
        self._num_tokens = int(extra.get("num_tokens", 0))

    @torch.no_grad()
    def evaluate(self, examples: list[dict]) -> dict:
        """Token-mean loss on `examples`. Every process evaluates all of them (ZeRO-3 needs every
        rank in every forward; eval sets are small)."""
        pipe, pad = self.pipeline, self.tokenizer.pad_token_id
        nll, n = 0.0, 0
        for i in range(0, len(examples), self.cfg.per_device_train_batch_size):
            b = collate(examples[i:i + self.cfg.per_device_train_batch_size], pad)
            r = pipe.forward(b["input_ids"], b["attention_mask"], b["labels"]).result()
            nll += r.loss * r.num_tokens
            n += r.num_tokens
        return {"eval/loss": nll / max(n, 1)}

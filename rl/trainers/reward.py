"""Reward-model training: the Bradley-Terry objective on preference pairs.

Objective (Bradley-Terry preference model; Ouyang et al. 2022, eq. 1; Christiano et al. 2017):
    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected) - margin)
         + center_rewards_coefficient * mean((r_chosen + r_rejected)^2)      (Eisenstein et al. 2023)
exactly TRL 1.16's `RewardTrainer.compute_loss` (checked against it in tests/unit/trainers/test_reward.py), with
TRL's metric names (`loss`, `accuracy`, `margin`, `mean_reward`, `min_reward`, `max_reward`) plus
`std_reward` and `rewards/chosen`, `rewards/rejected`.

The models and their pooling are in rl.reward_model, the checkpoint format, text encoding and
preference files in rl.models.reward_format; their public names are importable from here too.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

import torch

from rl.algos.preference import bradley_terry_loss
from rl.config.parse import to_dict
from rl.config.plan import epoch_plan
from rl.data.preference import (
    EncodedPairs,
    PreferencePairs,
    encode_pairs,
    load_preference_pairs,
    pair_batch,
)
from rl.data.records import source_options, split_eval
from rl.engine.dist import build_accelerator
from rl.engine.optim import build_scheduler
from rl.engine.packing import pack_sequences
from rl.engine.tracking import Tracker
from rl.errors import ConfigError
from rl.models.loading import configure_tokenizer, load_tokenizer, seed_run, trainable_fraction
from rl.models.reward import RewardModel, RewardModelConfig
from rl.models.reward_format import save_reward_model
from rl.trainers.base import CallbackTracker
from rl.trainers.epoch import EpochTrainer
from rl.trainers.reward_config import RewardTrainConfig


def _bt_custom_loss(model, inputs, outputs, n_pairs: int, scale: float = 1.0, margin=None,
                    center_rewards_coefficient=None):
    """forward_backward_custom loss: rewards [0, n) are chosen, [n, 2n) rejected (rows of a padded
    batch, or sequences 0..2n-1 of packed rows).

    The micro-batch's Bradley-Terry mean times `scale` = its pairs x world x accumulation / the pairs of
    the optimizer step (0 for a dummy micro-batch, 1 in a full step): the engine's 1/accumulation and
    DDP's 1/world then leave exactly the mean over the step's pairs, center term included, however a
    short last step splits (rl.trainers.epoch). The mean metrics are scaled alike; the pooled sums
    (`_sum`, `_n`, ...) and the extremes leave a dummy out."""
    r = outputs["rewards"][:, 0]
    chosen, rejected = r[:n_pairs], r[n_pairs:]
    if margin is not None:
        margin = margin.to(r.device, r.dtype)
    loss, m = bradley_terry_loss(chosen, rejected, margin, center_rewards_coefficient)
    rd, real = r.detach(), float(scale > 0)
    tokens = (inputs["sequence_index"] >= 0).sum() if "sequence_index" in inputs else inputs["attention_mask"].sum()
    m = {k: v * scale for k, v in m.items()}
    m.update({"rewards/chosen": chosen.detach().mean() * scale, "rewards/rejected": rejected.detach().mean() * scale,
              "min_reward": rd.min() if real else math.inf, "max_reward": rd.max() if real else -math.inf,
              "_sum": rd.sum() * real, "_sumsq": (rd ** 2).sum() * real, "_n": rd.numel() * real,
              "_tokens": tokens * real})
    return loss * scale, m


class RewardModelTrainer(EpochTrainer):
    """Trains a `RewardModel` on preference pairs with the Bradley-Terry loss, on the offline trainers'
    lifecycle (rl.trainers.epoch): a seeded shuffle per epoch, one global batch of batch_size x
    gradient_accumulation_steps x processes pairs per optimizer step (a smaller last step when the pairs
    do not fill it), each micro-batch's chosen and rejected texts in one forward, through the
    `ForwardBackwardPipeline` (single process, DDP or DeepSpeed ZeRO alike).

    `config` is a `RewardModelConfig` (or the recipe's `RewardTrainConfig`, the same class with the
    house defaults); the model reads the same object."""

    def __init__(self, config: RewardModelConfig | None = None, *, model: RewardModel | None = None,
                 tokenizer=None, device: str | None = None, accelerator=None, output_dir: str | Path | None = None):
        if model is None and config is None:
            raise ConfigError("RewardModelTrainer needs a config (a RewardModelConfig) or a model")
        self.cfg = self.config = config or model.config
        self.model = model if model is not None else RewardModel(self.config, tokenizer=tokenizer)
        self.tokenizer = tokenizer if tokenizer is not None else self.model.get_tokenizer()
        self.model.tokenizer = self.tokenizer
        self.device = device
        self.accelerator = accelerator or build_accelerator(
            self.config.gradient_accumulation_steps, device, max_grad_norm=self.config.max_grad_norm)
        self.output_dir = Path(output_dir if output_dir is not None else self.config.output_dir)
        self.pipeline = None
        self.history: list[dict] = []
        self.eval_split: EncodedPairs | None = None

    @classmethod
    def from_recipe(cls, cfg: RewardTrainConfig) -> "RewardModelTrainer":
        """The trainer a launch/reward.py recipe describes: seeded, with the recipe's accelerator
        (DeepSpeed config included), tokenizer and model; `train_recipe` then runs it."""
        seed_run(cfg)
        accelerator = build_accelerator(cfg.gradient_accumulation_steps, device=cfg.device,
                                        micro_batch_size=2 * cfg.per_device_train_batch_size,
                                        max_grad_norm=cfg.max_grad_norm, deepspeed_config=cfg.deepspeed)
        tokenizer = configure_tokenizer(load_tokenizer(cfg.model_name, cfg.trust_remote_code, revision=cfg.model_revision),
                                        cfg)
        return cls(cfg, model=RewardModel(cfg, tokenizer=tokenizer), tokenizer=tokenizer, accelerator=accelerator)

    def train_recipe(self, cfg: RewardTrainConfig, train: PreferencePairs, evals: PreferencePairs | None) -> dict:
        """`train_on_preferences` as the recipe says (epochs, batch size, eval split), logged by a Tracker."""
        tracker = Tracker(cfg.output_dir, cfg.report_to, cfg.run_name, to_dict(cfg),
                          is_main=self.accelerator.is_main_process, desc="reward",
                          plot_keys=["loss", "accuracy", "margin", "eval/accuracy", "learning_rate"])
        n_train, n_all = trainable_fraction(self.model)
        tracker.write(f"reward model: {n_train:,} of {n_all:,} parameters trainable ({100 * n_train / n_all:.2f}%), "
                      f"{len(train)} pairs, {self.processes}")
        eval_data = ({"chosen": evals.chosen, "rejected": evals.rejected, "prompts": evals.prompts,
                      "margins": evals.margins} if evals is not None else None)
        return self.train_on_preferences(
            train.chosen, train.rejected, prompts=train.prompts, margins=train.margins, num_epochs=cfg.num_train_epochs,
            batch_size=cfg.per_device_train_batch_size, eval_fraction=0.0 if evals is not None else cfg.data.eval_fraction,
            eval_data=eval_data, tracker=tracker)

    # ------------------------------------------------------------------ data
    @staticmethod
    def load_data(cfg: RewardTrainConfig) -> tuple[PreferencePairs, PreferencePairs | None]:
        """The recipe's training pairs and its eval pairs (None without data.eval_path), validated."""
        d = cfg.data
        cols = dict(prompt_column=d.prompt_column, chosen_column=d.chosen_column,
                    rejected_column=d.rejected_column, margin_column=cfg.margin_column)
        train = load_preference_pairs(d.path, max_examples=d.max_examples, **cols,
                                      **source_options(d, seed=cfg.seed))
        evals = load_preference_pairs(d.eval_path, **cols, **source_options(d, True)) if d.eval_path else None
        return train, evals

    @staticmethod
    def dry_run_models(cfg: RewardTrainConfig) -> dict:
        """The models a run holds, for the dry-run memory plan."""
        return {"reward model (trainable)": cfg.model_name}

    def _encode(self, chosen, rejected, prompts=None, margins=None) -> EncodedPairs:
        return encode_pairs(self.model.encode, chosen, rejected, prompts, margins)

    def plan(self, n_pairs: int, batch_size: int, num_epochs: int) -> dict:
        """Derived sizes, computed once (`rl.config.plan.epoch_plan`; `max_steps` wins over num_epochs)."""
        if batch_size < 1 or num_epochs < 1:
            raise ValueError(f"batch_size and num_epochs must be at least 1, got {batch_size} and {num_epochs}")
        sizes = SimpleNamespace(per_device_train_batch_size=batch_size, num_train_epochs=num_epochs, max_steps=self.cfg.max_steps,
                                gradient_accumulation_steps=self.cfg.gradient_accumulation_steps)
        return epoch_plan(sizes, n_pairs, self.world, "pairs")

    def _batch(self, split: EncodedPairs, idx: Sequence[int]):
        """(ids, mask, margin, packed): a padded pair batch, or with `packing` the pairs' 2B texts as
        packed rows (`rl.engine.packing.pack_sequences`): mask None and `packed` their position_ids and
        sequence_index for the model (else {})."""
        if not self.config.packing:
            side = getattr(self.tokenizer, "padding_side", "right")
            return (*pair_batch(split, idx, self.model.pad_token_id, side), {})
        part = split.take(idx)
        b = pack_sequences([(s, s) for s in part.chosen + part.rejected], self.model.pad_token_id)
        margin = torch.tensor(part.margin, dtype=torch.float32) if part.margin is not None else None
        return b["input_ids"], None, margin, {k: b[k] for k in ("position_ids", "sequence_index")}

    # ------------------------------------------------------------------ setup
    def _setup(self, total_steps: int, batch_size: int) -> None:
        """The base's pipeline (`Trainer.build_pipeline`), built once; its schedule warms up over
        `warmup_steps` (capped at the run length) unless warmup_ratio > 0 or warmup_steps is null. A
        second train_on_preferences call: a fresh schedule over its steps on the same optimizer."""
        cfg = self.config
        warmup = (None if cfg.warmup_ratio or cfg.warmup_steps is None
                  else min(cfg.warmup_steps, max(0, total_steps - 1)))
        if self.pipeline is None:
            self._fill_deepspeed_sizes()
            self.pipeline = self.build_pipeline(self.model, total_steps, 2 * batch_size, warmup_steps=warmup)
            return
        # a second train_on_preferences call: a fresh schedule on the same optimizer
        optimizer = self.pipeline.scheduler.optimizer  # the torch optimizer the engine steps
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"]  # the peak, as the first schedule found it
        self.pipeline.scheduler = build_scheduler(optimizer, cfg.lr_scheduler_type, total_steps, cfg.warmup_ratio, warmup,
                                                  cfg.lr_scheduler_kwargs)

    def _fill_deepspeed_sizes(self) -> None:
        """Fill ZeRO's hidden-size based "auto" buckets as accelerate would: it reads
        `model.config.hidden_size`, which our wrapper's config (a RewardModelConfig) lacks."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is None:
            return
        h = self.model.hf_config.get_text_config().hidden_size
        zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
        for key, value in (("reduce_bucket_size", h * h), ("stage3_prefetch_bucket_size", int(0.9 * h * h)),
                           ("stage3_param_persistence_threshold", 10 * h)):
            if zero.get(key) == "auto":
                zero[key] = value

    # ------------------------------------------------------------------ training
    def train_on_preferences(self, chosen_texts: Sequence[str], rejected_texts: Sequence[str],
                             prompts: Sequence[str] | None = None, num_epochs: int | None = None,
                             batch_size: int | None = None,
                             eval_fraction: float = 0.0, margins: Sequence[float] | None = None,
                             eval_data: dict | None = None, log_fn: Callable[[int, dict], None] | None = None,
                             tracker=None) -> dict[str, float]:
        """Train on pairs (optionally with `prompts` prepended and per-pair `margins`), `num_epochs` passes
        in micro-batches of `batch_size` pairs per process (None: the config's, by default 1 and 8).

        `eval_fraction` holds out that share of the pairs for `evaluate()` (`rl.data.records.split_eval`:
        seeded, floor(fraction x pairs), at least one); `eval_data` (`{"chosen": [...], "rejected": [...],
        "prompts": [...]}`) gives a separate eval set instead. Pairs that do not fill the last global
        batch of an epoch make a smaller last step (one warning line). `log_fn(step, metrics)` is called
        after every optimizer step (and with eval metrics), or give a `rl.engine.tracking.Tracker` as
        `tracker`. Checkpoints, resume and signals follow the run core (rl.trainers.base):
        `config.save_steps`, `config.resume`, `config.save_total_limit`. A second call continues the
        same optimizer (steps numbered on) with a fresh schedule. Returns the last step's metrics plus
        the final evaluation."""
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        data = self._encode(chosen_texts, rejected_texts, prompts, margins)
        if len(data) == 0:
            raise ValueError("no preference pairs to train on")
        train = data
        if eval_data is not None:
            self.eval_split = self._encode(eval_data["chosen"], eval_data["rejected"], eval_data.get("prompts"),
                                           eval_data.get("margins"))
        elif eval_fraction > 0:
            kept, held = split_eval(list(range(len(data))), eval_fraction, self.config.seed)
            if not kept:
                raise ValueError(f"eval_fraction={eval_fraction} leaves no training pairs out of {len(data)}")
            self.eval_split, train = data.take(held), data.take(kept)
        batch_size = self.config.per_device_train_batch_size if batch_size is None else batch_size
        plan = self._plan = self.plan(len(train), batch_size, self.config.num_train_epochs if num_epochs is None else num_epochs)
        done = self.pipeline.step if self.pipeline is not None else 0  # steps of earlier calls
        self._setup(plan["total_steps"], batch_size)
        self.model.train()
        self._train, self._bs = train, batch_size
        tracker = tracker or CallbackTracker(log_fn)
        if plan["warning"]:
            tracker.write(plan["warning"])
        self.start_epochs(len(train))
        rows = self.fit(done + plan["total_steps"], tracker)
        self.history += rows
        last = next((r for r in reversed(rows) if "loss" in r), {})
        return {k: v for k, v in last.items() if k != "step"}

    # ------------------------------------------------------------------ the lifecycle's hooks
    # (current_step is the base's: the engine's step, pipeline.step)
    @property
    def run_dir(self) -> Path:
        return self.output_dir

    def train_step(self) -> dict:
        pipe, cfg = self.pipeline, self.config
        step_pairs = self.next_global_batch()
        unit = self.step_weight(len(step_pairs))
        futures = []
        for idx in self.micro_batches(step_pairs):
            # an empty micro-batch (a short last step) still runs one forward/backward, on a pair weighed 0
            pairs = idx or step_pairs[:1]
            ids, mask, margin, packed = self._batch(self._train, pairs)
            futures.append(pipe.forward_backward_custom(
                _bt_custom_loss, ids, mask, model_inputs=packed, n_pairs=len(pairs), scale=len(idx) * unit,
                margin=margin, center_rewards_coefficient=cfg.center_rewards_coefficient))
        step = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
        metrics = self._step_metrics([f.result() for f in futures], step)
        return {"step": pipe.step, **metrics, "epoch": self.epoch_progress}

    def evaluate_now(self) -> dict | None:
        return self.evaluate(batch_size=self._bs) if self.eval_split is not None else None

    def restore(self, extra: dict) -> None:
        if "epoch" not in extra:  # a checkpoint of the former trainer: {"done": steps of this call, ...}
            extra = dict(zip(("epoch", "batch_index"), divmod(int(extra["done"]), self._plan["steps_per_epoch"])))
        super().restore(extra)

    def _step_metrics(self, results, step) -> dict[str, float]:
        """Metrics of the step over its micro-batches and processes: the means exact for any split (see
        `_bt_custom_loss`), std from pooled sums, extremes over the real pairs."""
        keys = ["loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected"]  # scaled: sums are step means
        vals = [sum((r.loss if k == "loss" else r.metrics[k]) for r in results) / len(results) for k in keys]
        sums = [sum(r.metrics[k] for r in results) for k in ("_sum", "_sumsq", "_n", "_tokens")]
        mn = min(r.metrics["min_reward"] for r in results)
        mx = max(r.metrics["max_reward"] for r in results)
        acc = self.accelerator
        t = torch.tensor(vals + sums, dtype=torch.float64, device=acc.device)
        ext = torch.tensor([-mn, mx], dtype=torch.float64, device=acc.device)
        if acc.num_processes > 1:
            t = acc.reduce(t, reduction="sum")
            t[:len(keys)] /= acc.num_processes
            ext = acc.gather(ext).view(-1, 2).max(0).values
        out = dict(zip(keys, t[:len(keys)].tolist()))
        s, sq, n, tokens = t[len(keys):].tolist()
        mean = s / n
        out.update(mean_reward=mean, std_reward=math.sqrt(max(0.0, sq / n - mean * mean)),
                   min_reward=-float(ext[0]), max_reward=float(ext[1]), num_tokens=tokens,
                   learning_rate=step.learning_rate, grad_norm=step.grad_norm)
        return out

    @torch.no_grad()
    def evaluate(self, chosen_texts: Sequence[str] | None = None, rejected_texts: Sequence[str] | None = None,
                 prompts: Sequence[str] | None = None, margins: Sequence[float] | None = None,
                 batch_size: int = 8) -> dict[str, float]:
        """Loss, accuracy, margin and reward statistics (`eval/...`) on the given pairs or the
        held-out split. Every process scores every pair (identical results, no gather needed)."""
        split = self._encode(chosen_texts, rejected_texts, prompts, margins) if chosen_texts is not None \
            else self.eval_split
        if split is None or len(split) == 0:
            raise ValueError("nothing to evaluate: pass chosen_texts/rejected_texts or train with eval_fraction > 0")
        model = self.pipeline.model if self.pipeline is not None else self.model
        was_training = self.model.training
        model.eval()
        rc, rr = [], []
        for s in range(0, len(split), batch_size):
            idx = list(range(s, min(s + batch_size, len(split))))
            ids, mask, _, packed = self._batch(split, idx)
            dev = self.accelerator.device
            r = model(input_ids=ids.to(dev), attention_mask=None if mask is None else mask.to(dev),
                      **{k: v.to(dev) for k, v in packed.items()})["rewards"][:, 0].float().cpu()
            rc.append(r[:len(idx)])
            rr.append(r[len(idx):])
        model.train(was_training)
        rc, rr = torch.cat(rc), torch.cat(rr)
        margin = torch.tensor(split.margin) if split.margin is not None else None
        loss, m = bradley_terry_loss(rc, rr, margin, self.config.center_rewards_coefficient)
        allr = torch.cat([rc, rr])
        return {"eval/loss": float(loss), "eval/accuracy": float(m["accuracy"]), "eval/margin": float(m["margin"]),
                "eval/rewards/chosen": float(rc.mean()), "eval/rewards/rejected": float(rr.mean()),
                "eval/mean_reward": float(allr.mean()), "eval/std_reward": float(allr.std(unbiased=False))}

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, path: str | Path) -> Path:
        """Save the (trained) model to directory `path`; call it on every process (ZeRO-3 gathers
        the weights), only the main process writes."""
        if self.pipeline is not None:
            acc = self.accelerator
            sd = acc.get_state_dict(self.pipeline.model)
            if acc.is_main_process:
                save_reward_model(acc.unwrap_model(self.pipeline.model), path, sd)
            acc.wait_for_everyone()
            return Path(path)
        return save_reward_model(self.model, path)

    def load_model(self, path: str | Path) -> None:
        """Load weights saved by `save_model` into this trainer's model (before or after training)."""
        self.model.load_weights(path)

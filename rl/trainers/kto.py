"""KTO (Ethayarajh et al. 2024) on unpaired rows (prompt, completion, label), as TRL 1.16's KTOTrainer.

Objective (`rl.algos.kto`): with r = log pi(y|x) - log ref(y|x) (sums over the completion's tokens) and
the reference point z0 = max(0, mean KL log-ratio of the micro-batch's MISMATCHED rows), detached,

    desirable   (label true):  desirable_weight   * (1 - sigmoid(beta (r - z0)))
    undesirable (label false): undesirable_weight * (1 - sigmoid(beta (z0 - r)))

averaged over the rows of the optimizer step. The mismatched rows pair each prompt with the previous
row's completion within the micro-batch (`rl.data.kto.collate_unpaired`); they are scored by the policy
and the reference without gradient, and z0 is the mean of the processes' micro-batch means, clamped at
0 (TRL's order: gather, mean, clamp). A micro-batch therefore needs at least 2 rows (batch_size >= 2).

Metrics as TRL names them: loss, kl (z0), rewards/chosen and rewards/rejected (beta * r averaged over the
step's desirable / undesirable rows), rewards/margins, logps/chosen, logps/rejected; eval/... likewise.
TRL requires its sequential sampler so that a batch's mismatched rows are fixed; here `shuffle=false`
gives the file order (the cross-check uses it), the default reshuffles each epoch like the other trainers.
The reference is the one of every trainer (`rl.models.reference`): a frozen copy, or the policy with its
LoRA adapters off.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import torch

from rl.algos.kto import kl_reference_point, kto_loss
from rl.config.fields import opt
from rl.config.plan import epoch_plan
from rl.config.schema import RefSyncKeys, TrainConfig
from rl.data.kto import UnpairedDataset, collate_unpaired, load_unpaired_records
from rl.data.preference import shard_batches
from rl.engine.scoring import sequence_logprobs, sequence_logps
from rl.errors import ConfigError
from rl.trainers.epoch import EpochTrainer

_SUMS = ("n_c", "n_r", "rew_c", "rew_r", "logps_c", "logps_r")


def kto_batch_loss(logits, labels, attention_mask, *, ref_logps, desirable, z0, beta: float,
                   desirable_weight: float = 1.0, undesirable_weight: float = 1.0, row_weight=None):
    """The engine's loss callable: logits (B, T, V) of the micro-batch's rows. Returns (sum_i w_i l_i, sums)
    with w_i = `row_weight` (world * accumulation / rows-in-the-step, 0 for a padding row; default 1/B, the
    mean), and the sums of rewards/log-probs and counts per label that the trainer turns into TRL's means."""
    logps, _ = sequence_logps(logits, labels)
    per_row, rewards = kto_loss(logps, ref_logps, desirable, z0, beta, desirable_weight, undesirable_weight)
    w = (torch.full_like(per_row, 1.0 / len(per_row)) if row_weight is None else row_weight.to(per_row.dtype))
    loss = (per_row * w).sum()
    real, d = (w > 0).to(per_row.dtype), desirable.to(per_row.device)
    c, r = real * d, real * (~d)
    lp = logps.detach()
    metrics = {"loss": loss.detach(), "n_c": c.sum(), "n_r": r.sum(), "rew_c": (rewards * c).sum(),
               "rew_r": (rewards * r).sum(), "logps_c": (lp * c).sum(), "logps_r": (lp * r).sum()}
    return loss, metrics


def label_means(sums: dict[str, float]) -> dict[str, float]:
    """Step (or eval) sums -> TRL's rewards/* and logps/* means over the desirable / undesirable rows."""
    out = {}
    for side, key in (("c", "chosen"), ("r", "rejected")):
        if sums.get(f"n_{side}", 0) > 0:
            out[f"rewards/{key}"] = sums[f"rew_{side}"] / sums[f"n_{side}"]
            out[f"logps/{key}"] = sums[f"logps_{side}"] / sums[f"n_{side}"]
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


@dataclasses.dataclass
class KTOConfig(RefSyncKeys, TrainConfig):
    learning_rate: float = opt(1e-6, "peak learning rate of AdamW (KTO, like DPO, wants it small)")
    disable_dropout: bool = opt(True, "set every dropout of the trained model to 0 (TRL's default here)")
    beta: float = opt(0.1, "KTO temperature beta: how far the policy may move from the reference")
    desirable_weight: float = opt(1.0, "lambda_D, weight of the desirable rows' losses (the paper: keep "
                                  "desirable_weight * n_desirable / (undesirable_weight * n_undesirable) in [1, 4/3])")
    undesirable_weight: float = opt(1.0, "lambda_U, weight of the undesirable rows' losses")
    ref_model: str | None = opt(None, "reference model id/path (default: the initial policy)")
    max_prompt_length: int = opt(256, "prompts longer than this keep their last tokens (left truncation)")
    append_eos: bool = opt(True, "append EOS to plain-text completions so the model learns to stop")
    chat_template: bool = opt(False, "render plain-text prompt/completion as user/assistant turns with the "
                              "tokenizer's chat template (message-list data always uses it)")
    shuffle: bool = opt(True, "reshuffle the rows each epoch; false: file order, fixed batches (TRL's "
                        "sequential sampler)")
    eval_batch_size: int | None = opt(None, "rows per evaluation forward (default: per_device_train_batch_size)")

    def __post_init__(self):
        super().__post_init__()
        self.check_ref_sync()
        if self.beta <= 0:
            raise ConfigError(f"key 'beta' must be > 0, got {self.beta}")
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ConfigError("keys 'desirable_weight' and 'undesirable_weight' must be >= 0")
        if self.per_device_train_batch_size < 2 or (self.eval_batch_size is not None and self.eval_batch_size < 2):
            raise ConfigError("KTO's reference point pairs each row with another row's completion of its "
                              "micro-batch: batch_size (and eval_batch_size) must be at least 2")
        if not 1 <= self.max_prompt_length < self.max_length:
            raise ConfigError(f"max_prompt_length={self.max_prompt_length} must be at least 1 and below "
                              f"max_length={self.max_length}, or no completion token fits")


class KTOTrainer(EpochTrainer):
    """KTO on one ForwardBackwardPipeline (single process, DDP or DeepSpeed ZeRO-2/3).

    `KTOTrainer(config, *, model=None, tokenizer=None, ref_model=None)`; `.train(dataset, eval_dataset=None)`
    with `rl.data.kto.UnpairedDataset`s returns one metrics dict per optimizer step."""

    def __init__(self, config: KTOConfig, *, model=None, tokenizer=None, ref_model=None):
        self.build(config, model=model, tokenizer=tokenizer,
                   reference=dict(needed=True, name=config.ref_model, model=ref_model))

    @staticmethod
    def load_data(cfg: KTOConfig) -> tuple[list[dict], list[dict] | None]:
        return load_unpaired_records(cfg)

    @staticmethod
    def dry_run_models(cfg: KTOConfig) -> dict:
        return {"policy (trainable)": cfg.model_name, "reference (frozen)": cfg.ref_model or (
            "policy with LoRA disabled" if cfg.lora.enabled else cfg.model_name)}

    def plan(self, n_rows: int) -> dict:
        return epoch_plan(self.cfg, n_rows, self.world, "rows")

    # ------------------------------------------------------------------------------ scoring
    def _score(self, b: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """No-grad: reference log-probs of the rows, and z0's local term (policy minus reference on the
        mismatched rows), on this process's device."""
        acc, pipe, chunk = self.accelerator, self.pipeline, self.cfg.logprob_chunk_size
        b = {k: v.to(acc.device) for k, v in b.items()}

        def sums(model, prefix=""):
            logp, m = sequence_logprobs(model, b[f"{prefix}input_ids"], b[f"{prefix}attention_mask"],
                                        b[f"{prefix}labels"], chunk_size=chunk)
            return (logp * m).sum(-1)

        with torch.no_grad():
            kl_policy = sums(pipe.model, "kl_")
            with self.reference.use(pipe) as ref:
                ref_logps, kl_ref = sums(ref), sums(ref, "kl_")
        return ref_logps, kl_reference_point(kl_policy, kl_ref), b["label"]

    def _z0(self, local: torch.Tensor, has_rows: bool) -> float:
        """Mean over the processes (those with rows) of the local means, clamped at 0."""
        r = self.reduce({"kl": float(local) if has_rows else 0.0, "has": float(has_rows)}, op="sum")
        return max(0.0, r["kl"] / max(r["has"], 1.0))

    # -------------------------------------------------------------------------------- train
    def train(self, dataset: UnpairedDataset, eval_dataset: UnpairedDataset | None = None) -> list[dict]:
        cfg = self.cfg
        plan = self._plan = self.plan(len(dataset))
        if self.pipeline is None:
            self.pipeline = self.build_pipeline(self._model, plan["total_steps"], cfg.per_device_train_batch_size)
            self.reference.place(self.accelerator)
        tracker = self.open_run(plan["total_steps"], desc="kto")
        n_des = sum(e["label"] for e in dataset.examples)
        self.announce(tracker, f"kto: {len(dataset)} rows ({n_des} desirable, {len(dataset) - n_des} undesirable), "
                      f"{plan['total_steps']} steps, global batch {plan['global_batch']} rows",
                      f"reference {self.reference.mode}")
        self._train = dataset
        self.start_epochs(len(dataset), eval_dataset)
        self._loss_fn = partial(kto_batch_loss, beta=cfg.beta, desirable_weight=cfg.desirable_weight,
                                undesirable_weight=cfg.undesirable_weight)
        return self.fit(plan["total_steps"], tracker)

    def train_step(self) -> dict:
        cfg, pipe, data = self.cfg, self.pipeline, self._train
        t0 = time.time()
        N = cfg.gradient_accumulation_steps
        step_ids = self.next_global_batch()
        unit = self.step_weight(len(step_ids))
        loss, kl, sums = 0.0, 0.0, dict.fromkeys(_SUMS, 0.0)
        for idx in self.micro_batches(step_ids):
            # an empty micro-batch (short last step) still runs one forward/backward, weighted 0 (ZeRO-3)
            rows = idx or step_ids[:2]
            weight = torch.full((len(rows),), unit if idx else 0.0)
            b = collate_unpaired([data[i] for i in rows], data.pad_token_id)
            ref_logps, local, desirable = self._score(b)
            z0 = self._z0(local, bool(idx))
            r = pipe.forward_backward(b["input_ids"], b["attention_mask"], b["labels"], loss_fn=self._loss_fn,
                                      ref_logps=ref_logps, desirable=desirable, z0=z0, row_weight=weight).result()
            loss, kl = loss + r.metrics["loss"] / N, kl + z0 / N
            for k in _SUMS:
                sums[k] += r.metrics[k]
        o = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
        row = {"loss": self.reduce({"loss": loss})["loss"], "kl": kl, **label_means(self.reduce(sums, op="sum"))}
        row.update({"grad_norm": o.grad_norm, "learning_rate": o.learning_rate, "epoch": self.epoch_progress,
                    "step_time": time.time() - t0})
        return {"step": pipe.step, **row}

    @torch.no_grad()
    def evaluate(self, dataset: UnpairedDataset) -> dict[str, float]:
        """Row-weighted eval/loss, eval/kl (mean of the batches' z0) and the eval/rewards/*, eval/logps/* means."""
        cfg, acc = self.cfg, self.accelerator
        model = self.pipeline.model
        was_training = model.training
        model.eval()
        bs = cfg.eval_batch_size or cfg.per_device_train_batch_size
        totals, n_batches = {"loss": 0.0, "n": 0.0, "kl": 0.0, **dict.fromkeys(_SUMS, 0.0)}, 0
        for idx, weight in shard_batches(len(dataset), bs, acc.num_processes, acc.process_index):
            b = collate_unpaired([dataset[i] for i in idx], dataset.pad_token_id)
            ref_logps, local, desirable = self._score(b)
            z0 = self._z0(local, bool(weight.sum() > 0))
            logp, m = sequence_logprobs(model, b["input_ids"].to(acc.device), b["attention_mask"].to(acc.device),
                                        b["labels"].to(acc.device), chunk_size=cfg.logprob_chunk_size)
            per_row, rewards = kto_loss((logp * m).sum(-1), ref_logps, desirable, z0, cfg.beta,
                                        cfg.desirable_weight, cfg.undesirable_weight)
            w = weight.to(acc.device)
            c, r = w * desirable, w * (~desirable)
            lp = (logp * m).sum(-1)
            for k, v in (("loss", (per_row * w).sum()), ("n", w.sum()), ("n_c", c.sum()), ("n_r", r.sum()),
                         ("rew_c", (rewards * c).sum()), ("rew_r", (rewards * r).sum()),
                         ("logps_c", (lp * c).sum()), ("logps_r", (lp * r).sum())):
                totals[k] += float(v)
            totals["kl"] += z0
            n_batches += 1
        model.train(was_training)
        kl = totals.pop("kl") / max(n_batches, 1)
        totals = self.reduce(totals, op="sum")
        out = {"loss": totals["loss"] / max(totals["n"], 1.0), "kl": kl, **label_means(totals)}
        return {f"eval/{k}": v for k, v in out.items()}

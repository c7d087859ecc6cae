"""The DPO family: DPO (sigmoid, conservative label smoothing), IPO, hinge (SLiC), reference-free DPO, ORPO, SimPO.

Objective (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7): for a prompt x with a chosen
answer y_w and a rejected answer y_l,

    h = beta * [(log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))]
    sigmoid:  -log sigmoid(h)                                   (DPO)
              -(1-eps) log sigmoid(h) - eps log sigmoid(-h)      (conservative DPO, label_smoothing=eps;
                                                                  Mitchell 2023, "A note on DPO with noisy
                                                                  preferences")
    hinge:    max(0, 1 - h)                                     (SLiC-HF, Zhao et al. 2023)
    ipo:      (h_avg/beta - 1/(2 beta))^2                       (IPO, Azar et al. 2023, eq. 17)
    orpo:     NLL(y_w) - beta * log sigmoid(log odds(y_w) - log odds(y_l))   (ORPO, Hong et al. 2024, eq. 6)
    simpo:    -log sigmoid(beta (log pi(y_w)/|y_w| - log pi(y_l)/|y_l|) - gamma)   (SimPO, Meng et al. 2024,
                                                                  eq. 6; no reference, gamma = simpo_gamma)

log pi(y|x) is the SUM of the answer tokens' log-probs: prompt and padding tokens never count, so a pair
scores the same whatever its batch neighbours, the padding side or max_length (the reference
implementation summed over pad tokens and used one prompt length for the whole batch).

Deviations, all as in TRL 1.16 (which the tests cross-check against):
* IPO uses per-token averaged log-ratios (h_avg), which the IPO authors confirmed to TRL is what the paper's
  experiments used; the paper writes sequence sums.
* ORPO uses per-token averaged log-probs for the odds (as the paper) and the chosen answer's mean token
  NLL per pair; its "rewards" are beta * mean log-prob (no reference exists).
* An EOS token is appended to plain-text answers so the model learns to stop.

Reference model, in order of preference for memory: none (reference_free, ORPO); precomputed log-probs
(one no-grad pass before training, then no reference in memory at all); the policy with its LoRA adapters
disabled (no second copy); a frozen copy, sharded as its own DeepSpeed engine under ZeRO-3.

Chosen and rejected answers go through ONE forward of the concatenated batch [chosen..., rejected...].
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from functools import partial

import torch

from rl.algos.preference import (
    needs_reference,
    preference_loss,
)
from rl.algos.registry import check, choices
from rl.config.fields import one_of_list, opt
from rl.config.plan import epoch_plan
from rl.config.schema import RefSyncKeys, TrainConfig
from rl.data.preference import (
    PreferenceDataset,
    collate_pairs,
    load_pair_records,
    pack_pairs,
    pack_pairs_shared,
    shard_batches,
)
from rl.engine import segments
from rl.engine.scoring import concatenated_logps, sequence_logps
from rl.errors import ConfigError
from rl.trainers.epoch import EpochTrainer

logger = logging.getLogger(__name__)


# ============================================================================== pure loss functions
# The per-pair losses (sigmoid, ipo, hinge, orpo) and preference_loss are in rl.algos.preference (names
# kept importable from here); the per-sequence log-probs of a collated batch are in rl.data.preference.

def dpo_batch_loss(logits, labels, attention_mask, *, loss_type: str, beta: float, label_smoothing: float = 0.0,
                   ref_chosen_logps=None, ref_rejected_logps=None, pair_weight=None, sequence_index=None,
                   hyper=None):
    """The engine's loss callable: logits of the concatenated batch [chosen..., rejected...] (2B, T, V),
    or of its packed rows (R, W, V) with their `sequence_index` (R, W) (`rl.data.preference.pack_pairs`).

    Returns (mean loss over the B pairs, batch-mean metrics); with `pair_weight` (B,) the weighted sums
    sum_i w_i l_i instead. The trainer gives w_i = world * accumulation / pairs-in-the-step (0 for a
    padding pair), so that the engine's 1/accumulation and DDP's 1/world leave the exact mean over the
    optimizer step's pairs even when its micro-batches are unequal (a short last batch)."""
    logps, lengths = sequence_logps(logits, labels, sequence_index)
    chosen, rejected = logps.chunk(2)
    c_len, r_len = lengths.chunk(2)
    per_pair, stats = preference_loss(loss_type, chosen, rejected, ref_chosen_logps, ref_rejected_logps,
                                      c_len, r_len, beta, label_smoothing, hyper)
    if pair_weight is None:
        loss = per_pair.mean()
        metrics = {k: v.mean() for k, v in stats.items()}
    else:
        w = pair_weight.to(per_pair.dtype)
        loss = (per_pair * w).sum()
        metrics = {k: (v * w).sum() for k, v in stats.items()}
    metrics["loss"] = loss.detach()
    return loss, metrics


# ================================================================================= configuration

def _packed_loss(loss_fn, labels, sequence_index, loss_kw, model, inputs, outputs):
    """`dpo_batch_loss` as a custom loss of `forward_backward_custom` (packed rows whose forward also
    carries the sequences' boundaries, rl.engine.segments)."""
    dev = inputs["input_ids"].device
    kw = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in loss_kw.items()}
    return loss_fn(outputs.logits, labels.to(dev), None, sequence_index=sequence_index.to(dev), **kw)


@dataclasses.dataclass
class DPOConfig(RefSyncKeys, TrainConfig):
    learning_rate: float = opt(1e-6, "peak learning rate of AdamW (DPO wants it small: 1e-6 to 1e-5)")
    disable_dropout: bool = opt(True, "set every dropout of the trained model to 0 (TRL's default here)")
    beta: float = opt(0.1, "DPO temperature beta (IPO: tau; ORPO: lambda, the weight of the odds-ratio term)")
    label_smoothing: float = opt(0.0, "conservative DPO: probability a preference label is flipped, in [0, 0.5)")
    simpo_gamma: float = opt(0.5, "SimPO's target reward margin gamma (loss_type=simpo only)")
    loss_type: str | list[str] = opt("sigmoid", f"preference loss ({choices('preference_loss')}): sigmoid (DPO), ipo, hinge "
                         "(SLiC), orpo (reference-free odds ratio + chosen NLL), simpo (reference-free, "
                         "length-normalised, margin simpo_gamma), or your own function")
    reference_free: bool = opt(False, "no reference model: its log-probs count as 0")
    precompute_ref_logps: bool = opt(False, "compute reference log-probs in one pass before training, then "
                                     "train without any reference forward or reference model in memory")
    ref_model: str | None = opt(None, "reference model id/path (default: the initial policy)")
    max_prompt_length: int = opt(256, "prompts longer than this keep their last tokens (left truncation)")
    append_eos: bool = opt(True, "append EOS to plain-text answers so the model learns to stop")
    chat_template: bool = opt(False, "render plain-text prompt/answers as user/assistant turns with the "
                              "tokenizer's chat template (message-list data always uses it)")
    eval_batch_size: int | None = opt(None, "pairs per evaluation forward (default: per_device_train_batch_size)")
    precompute_ref_batch_size: int | None = opt(None, "pairs per forward of precompute_ref_logps (null: "
                                                "eval_batch_size, else per_device_train_batch_size)")
    packing: bool = opt(False, "padding-free micro-batches: each micro-batch's chosen and rejected sequences "
                        "packed into rows no longer than its longest, with per-sequence position_ids "
                        "(rl.engine.packing); same loss, no compute on padding (training, reference and eval "
                        "forwards). Off by default: on SmolLM2 with pairs of near-equal length it measured "
                        "slower than padding (bench/bench_dpo.py); it pays on long-tailed pairs")
    share_prompt_forward: bool = opt(True, "compute each pair's prompt once for its chosen and rejected answers, "
                                     "packed without padding (rl.data.preference.pack_pairs_shared; training, "
                                     "reference and eval forwards; same loss; SDPA models, else as packing says)")


    def __post_init__(self):
        super().__post_init__()
        self.check_ref_sync()
        self.loss_type = one_of_list(self.loss_type, "loss_type", "one preference loss per run here (TRL's list "
                                     "combines several: MPO)")
        check("preference_loss", self.loss_type, "loss_type")
        if self.beta <= 0:
            raise ConfigError(f"key 'beta' must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"key 'label_smoothing' must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "simpo"):
            raise ConfigError(f"label_smoothing={self.label_smoothing} applies to loss_type=sigmoid or simpo only "
                              f"(got loss_type={self.loss_type}); set label_smoothing=0")
        if not 1 <= self.max_prompt_length < self.max_length:
            raise ConfigError(f"max_prompt_length={self.max_prompt_length} must be at least 1 and below "
                              f"max_length={self.max_length}, or no answer token fits")
        if self.precompute_ref_logps and self.uses_no_reference:
            raise ConfigError(f"precompute_ref_logps=true has nothing to precompute with "
                              f"{'reference_free=true' if self.reference_free else f'loss_type={self.loss_type}'}; "
                              f"set precompute_ref_logps=false")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ConfigError(f"key 'eval_batch_size' must be at least 1, got {self.eval_batch_size}")

    @property
    def uses_no_reference(self) -> bool:
        return self.reference_free or not needs_reference(self.loss_type)


# ===================================================================================== trainer

class DPOTrainer(EpochTrainer):
    """DPO-family training on one ForwardBackwardPipeline (single process, DDP or DeepSpeed ZeRO-2/3).

    `DPOTrainer(config, *, model=None, tokenizer=None, ref_model=None)`: missing pieces are loaded from
    `config.model_name`. `.train(dataset, eval_dataset=None)` returns the metric history, a list with
    one dict per optimizer step (`step`, `loss`, `rewards/*`, `logps/*`, `grad_norm`, `lr`, and the
    `eval_*` metrics on evaluation steps).
    """

    def __init__(self, config: DPOConfig, *, model=None, tokenizer=None, ref_model=None):
        self.build(config, model=model, tokenizer=tokenizer,
                   reference=dict(needed=not config.uses_no_reference, name=config.ref_model, model=ref_model))

    @property
    def ref_mode(self) -> str:
        return self.reference.mode

    # ------------------------------------------------------------------------------------ data
    @staticmethod
    def load_data(cfg: DPOConfig) -> tuple[list[dict], list[dict] | None]:
        """The recipe's validated training rows and eval rows (data.eval_path or data.eval_fraction)."""
        return load_pair_records(cfg)

    @staticmethod
    def dry_run_models(cfg: DPOConfig) -> dict:
        """The models a run holds, for the dry-run memory plan: the reference as `ReferencePolicy` decides."""
        models = {"policy (trainable)": cfg.model_name}
        if not cfg.uses_no_reference:
            models["reference (frozen)"] = ("precomputed log-probs of " if cfg.precompute_ref_logps else "") + \
                (cfg.ref_model or ("policy with LoRA disabled" if cfg.lora.enabled else cfg.model_name))
        return models

    # ----------------------------------------------------------------------------------- sizes
    def plan(self, n_pairs: int) -> dict:
        """Derived sizes, computed once (see `rl.config.fields.epoch_plan`)."""
        return epoch_plan(self.cfg, n_pairs, self.world, "pairs")

    def _collate(self, examples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
        """A micro-batch of pairs: one row with each prompt computed once (`share_prompt_forward`,
        `pack_pairs_shared`), packed rows with `packing` (`pack_pairs`), else padded (`collate_pairs`)."""
        if getattr(self, "_share", False):
            return pack_pairs_shared(examples, pad_token_id)
        return (pack_pairs if self.cfg.packing else collate_pairs)(examples, pad_token_id)

    # ------------------------------------------------------------------------------- reference
    def _setup(self, total_steps: int) -> None:
        cfg = self.cfg
        self.pipeline = self.build_pipeline(self._model, total_steps, cfg.per_device_train_batch_size)
        self.reference.place(self.accelerator)
        # packed training forwards attend per sequence (rl.engine.segments), not over each row's whole block mask
        kernel = (cfg.packing or cfg.share_prompt_forward) and segments.enable(self.pipeline.unwrapped_model)
        # each pair's prompt computed once for both answers (SDPA models; else the padded or packed batch)
        self._share = cfg.share_prompt_forward and kernel and segments.prefix_sharing(self.pipeline.unwrapped_model)
        # the segment path reads a packed batch's sequence_index: not when sharing was refused (GPT-2's learned
        # positions) and packing is off, where _collate gives a padded batch
        self._segments = kernel and (cfg.packing or self._share)

    def _reference_logps(self, batch: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Reference log-probs of a collated batch: precomputed, a forward of the frozen copy or of the
        policy with adapters disabled, or (None, None) when there is no reference."""
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if not self.reference.exists:
            return None, None
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        with self.reference.use(self.pipeline) as model:
            c, r, _, _ = concatenated_logps(model, batch, self.cfg.logprob_chunk_size)
        return c, r

    def precompute_reference(self, dataset: PreferenceDataset) -> None:
        """One no-grad pass that stores every pair's reference log-probs in `dataset.ref_logps` (N, 2).
        Pairs are split across processes and the results gathered, so each pair is scored once."""
        acc, cfg = self.accelerator, self.cfg
        bs = cfg.precompute_ref_batch_size or cfg.eval_batch_size or cfg.per_device_train_batch_size
        out = torch.zeros(len(dataset), 2)
        for idx, weight in shard_batches(len(dataset), bs, acc.num_processes, acc.process_index):
            batch = self._collate([dataset.examples[i] for i in idx], dataset.pad_token_id)
            c, r = self._reference_logps(batch)
            local = torch.stack([torch.tensor(idx, device=acc.device, dtype=torch.float32),
                                 weight.to(acc.device), c.float(), r.float()], dim=1)
            rows = acc.gather(local).cpu() if acc.num_processes > 1 else local.cpu()
            for i, w, cv, rv in rows.tolist():
                if w > 0:
                    out[int(i)] = torch.tensor([cv, rv])
        dataset.ref_logps = out

    # ----------------------------------------------------------------------------------- train
    def train(self, dataset: PreferenceDataset, eval_dataset: PreferenceDataset | None = None) -> list[dict]:
        cfg = self.cfg
        plan = self._plan = self.plan(len(dataset))
        if self.pipeline is None:
            self._setup(plan["total_steps"])
        tracker = self.open_run(plan["total_steps"], desc=f"dpo[{cfg.loss_type}]")
        self.announce(tracker, f"dpo: {len(dataset)} pairs, {plan['total_steps']} steps, global batch "
                      f"{plan['global_batch']} pairs", f"loss {cfg.loss_type}, reference "
                      f"{'precomputed' if cfg.precompute_ref_logps else self.ref_mode}")
        if cfg.precompute_ref_logps:
            t0 = time.time()
            for ds in (dataset, eval_dataset):
                if ds is not None and ds.ref_logps is None:
                    self.precompute_reference(ds)
            self.reference.release()  # no reference forward from here on: free its memory
            gc.collect()
            tracker.write(f"reference log-probs precomputed in {time.time() - t0:.1f}s")
        self._train = dataset
        self.start_epochs(len(dataset), eval_dataset)
        self._loss_fn = partial(dpo_batch_loss, loss_type=cfg.loss_type, beta=cfg.beta,
                                label_smoothing=cfg.label_smoothing, hyper={"simpo_gamma": cfg.simpo_gamma})
        return self.fit(plan["total_steps"], tracker)

    def train_step(self) -> dict:
        cfg, acc, pipe, dataset = self.cfg, self.accelerator, self.pipeline, self._train
        t0 = time.time()
        N = cfg.gradient_accumulation_steps
        step_pairs = self.next_global_batch()
        mine = step_pairs[acc.process_index::self.world]
        unit = self.world * N / len(step_pairs)  # see dpo_batch_loss: exact step mean for any split
        sums: dict[str, float] = {}
        for m in range(N):
            idx = mine[m * cfg.per_device_train_batch_size:(m + 1) * cfg.per_device_train_batch_size]
            # a short last step can leave this process a micro-batch with no pair: it still runs one
            # forward/backward (ZeRO-3 needs every rank in every forward) on a pair weighted 0
            weight = torch.full((len(idx),), unit) if idx else torch.zeros(1)
            b = self._collate([dataset[i] for i in (idx or step_pairs[:1])], dataset.pad_token_id)
            ref_c, ref_r = self._reference_logps(b)
            # Padded: right padding, so the engine's default positions equal b["position_ids"]. Packed: the
            # position ids and no mask (the engine then gives the model none), the sequence index to the loss.
            packed = {k: b[k] for k in ("position_ids", "sequence_index")} if "sequence_index" in b else {}
            loss_kw = dict(ref_chosen_logps=ref_c, ref_rejected_logps=ref_r, pair_weight=weight)
            if self._segments:  # the same loss; the model also gets the sequences' boundaries
                loss = partial(_packed_loss, self._loss_fn, b["labels"], b["sequence_index"], loss_kw)
                inputs = segments.shared_prefix_inputs(b) if "prefix_of" in b else segments.model_inputs(b["position_ids"])
                r = pipe.forward_backward_custom(loss, b["input_ids"], None, model_inputs=inputs).result()
            else:
                r = pipe.forward_backward(b["input_ids"], None if packed else b["attention_mask"], b["labels"],
                                          loss_fn=self._loss_fn, **loss_kw, **packed).result()
            for k, v in r.metrics.items():
                sums[k] = sums.get(k, 0.0) + v / N
        o = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
        row = self.reduce(sums)
        row.update({"grad_norm": o.grad_norm, "learning_rate": o.learning_rate, "epoch": self.epoch_progress,
                    "step_time": time.time() - t0})
        return {"step": pipe.step, **row}

    @torch.no_grad()
    def evaluate(self, dataset: PreferenceDataset) -> dict[str, float]:
        """Pair-weighted means of loss and rewards/logps metrics over `dataset`, as `eval_<name>`.
        Pairs are split across processes (padded so every rank runs the same forwards, as ZeRO-3 needs)."""
        cfg, acc = self.cfg, self.accelerator
        if self.pipeline is None:
            raise RuntimeError("evaluate() needs the trained model: call train() first")
        model = self.pipeline.model
        was_training = model.training
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        bs = cfg.eval_batch_size or cfg.per_device_train_batch_size
        for idx, weight in shard_batches(len(dataset), bs, acc.num_processes, acc.process_index):
            b = self._collate([dataset[i] for i in idx], dataset.pad_token_id)
            ref_c, ref_r = self._reference_logps(b)
            b = {k: v.to(acc.device) for k, v in b.items()}
            c, r, cl, rl = concatenated_logps(model, b)
            per_pair, stats = preference_loss(cfg.loss_type, c, r, _dev(ref_c, acc), _dev(ref_r, acc), cl, rl,
                                              cfg.beta, cfg.label_smoothing, {"simpo_gamma": cfg.simpo_gamma})
            w = weight.to(acc.device)
            for k, v in {"loss": per_pair, **stats}.items():
                totals[k] = totals.get(k, 0.0) + (v.float() * w).sum()
            totals["_n"] = totals.get("_n", 0.0) + w.sum()
        model.train(was_training)
        keys = sorted(totals)
        vec = torch.stack([totals[k] for k in keys])
        if acc.num_processes > 1:
            vec = acc.reduce(vec, "sum")
        n = vec[keys.index("_n")].clamp(min=1)
        return {f"eval/{k}": float(v / n) for k, v in zip(keys, vec) if k != "_n"}


def _dev(t, acc):
    return None if t is None else t.to(acc.device)

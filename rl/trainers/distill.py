"""On-policy distillation (GKD, Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
from Self-Generated Mistakes", alg. 1), as TRL 1.16's GKDTrainer: a student is trained to match a frozen
teacher's next-token distributions on completions of the data's prompts.

Each step takes the step's prompt rows (with a supervised `completion` column). With probability `lmbda`
(one seeded draw per step, a function of seed and step alone, so resume is exact) the completions are
replaced by the student's own samples (on-policy); otherwise the data's completions are used (with
`seq_kd`, the teacher's samples instead: sequence-level KD). One forward of the student and one of the
teacher over prompt + completion give, at every completion token t,

    loss = mean over completion tokens of JSD_beta(student(.|x, y_<t), teacher(.|x, y_<t))

(`rl.algos.distill.generalized_jsd`: beta = 0 forward KL, 1 reverse KL). `temperature` is the sampling
temperature; the loss compares the two distributions at temperature 1, as TRL 1.16's
GKDTrainer.compute_loss does (it calls generalized_jsd_loss without its temperature). The mean is over
every completion token of the whole optimizer step (all micro-batches, all processes), as SFT's
normalisation, so gradient accumulation is exact (TRL normalises by num_items_in_batch counted on the
data's labels, before an on-policy step replaces them).

Deviations and choices:
* The supervised completion is tokenised as SFT does (no BOS, EOS appended), cut at max_completion_length.
* TRL draws `random.random() <= lmbda` from the process-global RNG; here the draw is seeded per step and
  is the same on every process (all processes are on- or off-policy together).
* Prompts come from data rows only (no environment); the teacher must share the student's vocabulary.

Metrics: loss, grad_norm, learning_rate, on_policy (1 for a step on the student's samples, else 0),
completions/mean_length, step_time.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import torch

from rl.algos.distill import generalized_jsd
from rl.config.fields import opt
from rl.config.plan import prompts_step_problem
from rl.config.schema import OnlineConfig
from rl.data.columns import missing_column
from rl.data.records import has_data
from rl.engine.dist import zero_stage
from rl.engine.generation import generate
from rl.engine.packing import IGNORE_INDEX, left_pad, position_ids_from_mask
from rl.errors import ConfigError, DataError
from rl.models.loading import load_tokenizer, release_device_cache, vocabulary_mismatch
from rl.rollout.prompts import encode_prompt, load_prompt_rows, step_prompts
from rl.trainers.base import Trainer
from rl.trainers.sampling import rollout_sampler


@dataclasses.dataclass
class DistillConfig(OnlineConfig):
    teacher_model_name: str | None = opt(None, "the teacher: model id/path (required; it must share the student's "
                                         "vocabulary)")
    learning_rate: float = opt(2e-5, "peak learning rate of AdamW (TRL's GKD default)")
    lmbda: float = opt(0.5, "probability that a step's completions are the student's own samples (on-policy); "
                       "else the data's completions (TRL's name)")
    beta: float = opt(0.5, "interpolation of the generalised JSD: 0 forward KL(teacher||student), 1 reverse "
                      "KL(student||teacher)")
    temperature: float = opt(0.9, "sampling temperature (student, and teacher with seq_kd); the loss compares the "
                             "distributions at temperature 1, as TRL's GKDTrainer")
    seq_kd: bool = opt(False, "sequence-level KD: off-policy steps train on the teacher's samples instead of "
                       "the data's completions")
    vllm_importance_sampling_correction: bool = opt(
        False, "GRPO's and PPO's key: distillation's divergence loss has no policy-gradient term to reweight "
        "(TRL's GKDConfig has no such key); true is refused")

    def __post_init__(self):
        super().__post_init__()
        self.refuse_correction("distillation's divergence loss")
        if not self.teacher_model_name:
            raise ConfigError("key 'teacher_model_name' is required: the model to distil from")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ConfigError(f"key 'lmbda' must be in [0, 1], got {self.lmbda}")
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError(f"key 'beta' must be in [0, 1], got {self.beta}")
        if self.temperature <= 0:
            raise ConfigError(f"key 'temperature' must be > 0, got {self.temperature}")
        if self.env_type is not None:
            raise ConfigError("distillation takes its prompts and completions from data rows; env_type is not "
                              "supported (unset it and set data.path)")


# ============================================================================ pure pieces

def on_policy_draw(seed: int, step: int, lmbda: float) -> bool:
    """Whether step `step` trains on the student's samples: one seeded uniform draw < lmbda, the same on
    every process and a function of (seed, step) alone (resume-exact). lmbda 1: always, 0: never."""
    u = torch.rand((), generator=torch.Generator().manual_seed(seed * 1_000_003 + step + 17)).item()
    return u < lmbda


def completion_ids(tokenizer, text: str, max_tokens: int) -> list[int]:
    """A supervised completion's tokens as SFT's: no BOS, EOS appended, at most `max_tokens`."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return (tokenizer(text, add_special_tokens=False)["input_ids"] + eos)[:max_tokens]


def distill_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompts left-padded, completions right-padded after them (as `Rollout.to_batch`): input_ids,
    attention_mask, labels (-100 on prompt and padding), position_ids, each (B, P + N)."""
    p_ids, p_mask = left_pad(prompts, pad_id)
    N = max(1, max(len(c) for c in completions))
    c_ids = torch.full((len(completions), N), pad_id, dtype=torch.long)
    c_mask = torch.zeros((len(completions), N), dtype=torch.long)
    for i, c in enumerate(completions):
        c_ids[i, :len(c)] = torch.as_tensor(c, dtype=torch.long)
        c_mask[i, :len(c)] = 1
    input_ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, p_ids.shape[1]:] = c_ids.masked_fill(c_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels,
            "position_ids": position_ids_from_mask(mask)}


def distill_loss(logits, labels, attention_mask, *, teacher_logits: torch.Tensor, beta: float,
                 temperature: float, scale: float):
    """The summed generalised JSD over the completion tokens (labels != -100, shifted as in the LM loss),
    times `scale` (= processes x accumulation / completion tokens of the step): the engine's 1/accumulation
    and DDP's 1/processes then leave the token mean over the whole step."""
    mask = labels[:, 1:] != IGNORE_INDEX
    per = generalized_jsd(logits[:, :-1], teacher_logits[:, :-1].to(logits.device), beta, temperature)
    total = (per * mask).sum()
    return total * scale, {"jsd_sum": total.detach(), "tokens": mask.sum()}


# ============================================================================ trainer

class DistillTrainer(Trainer):
    """GKD on the shared lifecycle. `DistillTrainer(config, *, model=None, tokenizer=None, teacher=None,
    train_prompts=None)`: `teacher` a model to use instead of loading `teacher_model_name`; `train_prompts`
    rows {"prompt", <data.completion_column>} (default: read from data.path by the launch script)."""

    def __init__(self, config: DistillConfig, *, model=None, tokenizer=None, teacher=None,
                 train_prompts: list[dict] | None = None):
        self.train_prompts = train_prompts
        tokenizer = tokenizer or load_tokenizer(config.model_name, config.trust_remote_code)
        if teacher is None:  # before any model is loaded; a given teacher model has no tokenizer to compare
            # the loss compares the two next-token distributions id by id: equal sizes are not enough
            problem = vocabulary_mismatch(tokenizer, load_tokenizer(config.teacher_model_name,
                                                                    config.trust_remote_code))
            if problem:
                raise ConfigError(f"key 'teacher_model_name': {config.teacher_model_name}'s tokenizer {problem}; "
                                  f"distillation needs the student's vocabulary: use a teacher with the student's "
                                  f"tokenizer (model_name={config.model_name})")
        self.build(config, model=model, tokenizer=tokenizer,
                   reference=dict(name=config.teacher_model_name, model=teacher))

    @staticmethod
    def load_data(cfg: DistillConfig) -> list[dict]:
        """The recipe's prompt rows; each needs a non-empty completion unless every step is on-policy."""
        if not has_data(cfg.data):
            raise ConfigError("no prompts: set data.path or data.mixture (rows with 'prompt' and 'completion')")
        rows = load_prompt_rows(cfg.data.path, cfg)
        if cfg.lmbda < 1 and not cfg.seq_kd:
            col = cfg.data.completion_column
            present = {k for r in rows for k in r}
            if col not in present:  # the whole column: the key that maps it
                raise missing_column(str(cfg.data.path or "data.mixture"), col, present, "data.completion_column")
            for i, r in enumerate(rows):
                if not isinstance(r.get(col), str) or not r[col]:
                    raise DataError(f"{cfg.data.path}: row {i + 1}: column '{col}' must be a non-empty string "
                                    f"(the supervised completion; lmbda=1 samples every completion instead)")
        return rows

    @staticmethod
    def dry_run_models(cfg: DistillConfig) -> dict:
        return {"policy (trainable)": cfg.model_name, "teacher (frozen)": cfg.teacher_model_name}  # the student

    def plan(self) -> dict:
        """Derived sizes: prompts per step (per process and in all) and total steps."""
        cfg = self.cfg
        if not self.train_prompts:
            raise ConfigError("no prompts: pass train_prompts= or set data.path")
        per_process = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        per_step = per_process * self.world
        if len(self.train_prompts) < per_step:
            raise ConfigError(prompts_step_problem(cfg, len(self.train_prompts), self.world))
        total = cfg.max_steps or len(self.train_prompts) // per_step * cfg.num_train_epochs
        return {"prompts_per_process": per_process, "prompts_per_step": per_step, "total_steps": total}

    # ------------------------------------------------------------------ training
    def train(self) -> list[dict]:
        cfg, acc = self.cfg, self.accelerator
        plan = self._plan = self.plan()
        tracker = self.open_run(plan["total_steps"], desc="distill", plot_keys=["loss", "on_policy", "grad_norm"])
        self.pipeline = self.build_pipeline(self._model, plan["total_steps"], cfg.per_device_train_batch_size)
        self.reference.place(acc)
        s_vocab = self.pipeline.unwrapped_model.get_output_embeddings().weight.shape[0]
        teacher = self.reference.model
        t_vocab = teacher.get_output_embeddings().weight.shape[0] if hasattr(teacher, "get_output_embeddings") else s_vocab
        if s_vocab != t_vocab:
            raise ConfigError(f"teacher {cfg.teacher_model_name} has {t_vocab} output tokens, the student "
                              f"{s_vocab}; distillation needs the same vocabulary")
        tracker.write(f"distill (lmbda {cfg.lmbda}, beta {cfg.beta}, temperature {cfg.temperature}): "
                      f"{plan['total_steps']} steps of {plan['prompts_per_step']} prompts ({self.world} processes, "
                      f"ZeRO stage {zero_stage(acc)}), teacher {self.reference.description}, trainable "
                      f"{self.trainable:,}/{self.total_params:,} parameters")
        return self.fit(plan["total_steps"], tracker)

    def checkpoint_extra(self) -> dict:
        return {"step": self.pipeline.step}

    def step_batch(self, step: int) -> tuple[dict[str, torch.Tensor], bool]:
        """This process's prompt + completion batch of step `step` (B = batch_size x accumulation rows)
        and whether its completions are the student's samples."""
        cfg, acc, plan = self.cfg, self.accelerator, self._plan
        k = plan["prompts_per_process"]
        mine = step_prompts(None, self.train_prompts, cfg.order_seed, step,
                            plan["prompts_per_step"])[acc.process_index * k:(acc.process_index + 1) * k]
        prompts = [encode_prompt(self.tokenizer, r["prompt"], cfg.prompt_budget, cfg.chat_template) for r in mine]
        on_policy = on_policy_draw(cfg.seed, step, cfg.lmbda)
        if on_policy or cfg.seq_kd:
            seed = cfg.seed * 7_919 + (step * self.world + acc.process_index) * k  # row r samples seed + r
            model = self.pipeline.model if on_policy else self.reference.model
            # the student's samples may come from vLLM (use_vllm); the teacher's (seq_kd) from our sampler
            sample = rollout_sampler(self, generate) if on_policy else generate
            rollout = sample(model, self.tokenizer, prompts, max_new_tokens=cfg.max_completion_length,
                               temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)
            if cfg.optimize_device_cache:
                release_device_cache()
            completions = rollout.completions()
        else:
            completions = [completion_ids(self.tokenizer, r[cfg.data.completion_column], cfg.max_completion_length)
                           for r in mine]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return distill_batch(prompts, completions, pad), on_policy

    def _teacher_logits(self, b: dict) -> torch.Tensor:
        with self.reference.use(self.pipeline) as model:
            return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                         position_ids=b["position_ids"], use_cache=False).logits.float()

    def train_step(self) -> dict:
        cfg, acc, pipe = self.cfg, self.accelerator, self.pipeline
        t0 = time.time()
        batch, on_policy = self.step_batch(pipe.step)
        batch = {key: v.to(acc.device) for key, v in batch.items()}
        n_mine = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        n_all = int(self.reduce({"n": n_mine}, "sum")["n"])
        scale = self.world * cfg.gradient_accumulation_steps / max(n_all, 1)
        jsd_sum = 0.0
        for m in range(cfg.gradient_accumulation_steps):
            s = slice(m * cfg.per_device_train_batch_size, (m + 1) * cfg.per_device_train_batch_size)
            b = {key: v[s] for key, v in batch.items()}
            loss_fn = partial(distill_loss, teacher_logits=self._teacher_logits(b), beta=cfg.beta,
                              temperature=1.0, scale=scale)  # TRL's GKD: sampling temperature only
            r = pipe.forward_backward(b["input_ids"], b["attention_mask"], b["labels"], loss_fn=loss_fn,
                                      position_ids=b["position_ids"]).result()
            jsd_sum += r.metrics["jsd_sum"]
        o = pipe.optim_step(max_grad_norm=cfg.max_grad_norm).result()
        t = self.reduce({"jsd": jsd_sum, "len": float(n_mine)}, "sum")
        return {"step": pipe.step, "loss": t["jsd"] / max(n_all, 1), "grad_norm": o.grad_norm,
                "learning_rate": o.learning_rate, "on_policy": 1.0 if on_policy else 0.0,
                "completions/mean_length": t["len"] / (self._plan["prompts_per_step"]),
                "step_time": time.time() - t0}

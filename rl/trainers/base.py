"""The run lifecycle, written once for every trainer: resume, the step loop, evaluation and logging
cadence, a non-finite guard, stop signals, checkpoints with retention, and the run's exit status.

An algorithm subclasses `Trainer` and supplies only what is its own:

    train_step() -> dict            exactly one optimizer step and its metrics row (with "step"); what
                                    a trainer does between steps (sample a generation batch, a PPO
                                    rollout) it does inside the step that needs it and keeps cached
    evaluate_now() -> dict | None   held-out metrics, or None when nothing is configured to evaluate
    checkpoint_extra() -> dict      what a checkpoint must hold besides model/optimizer/scheduler/RNG
    restore(extra)                  the inverse, after a checkpoint was loaded

and calls `self.fit(total_steps, tracker)`. One optimizer step is one step of the loop, whatever the
trainer does between steps: logging, evaluation, checkpoints, the stop-signal check, `max_steps` and
the scheduler all count optimizer steps (a train_step that takes none or several is an error).
Everything else below is the same for all trainers, so each guarantee is proven once
(tests/unit/trainers/test_lifecycle.py runs it over all of them):

* `resume: auto` continues from the newest complete checkpoint; one whose files cannot be read is
  skipped with a warning and the previous complete one is used.
* A loss or gradient norm that is NaN or infinite stops the run at that step with `NonFiniteError`,
  before anything is saved: no NaN weights reach a checkpoint or the final model.
* SIGUSR1 / SIGTERM / SIGINT (Ctrl-C): the current step finishes, a checkpoint is written, and
  `stopped_by` holds the signal; the launch scripts then exit with 128 + signal (a scheduler can tell
  it from success). A second Ctrl-C aborts at once.
* `save_every` checkpoints, `save_total_limit` keeps only the newest N; a full disk removes the
  partial checkpoint and raises `RunError("no space left on <dir>")`, the previous one stays.
* A new run into an output_dir that holds a previous run is refused unless `resume` or
  `overwrite=true` is given (`check_output_dir`, called by the launch scripts before any model is built).
"""

from __future__ import annotations

import math
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

import torch

from rl.config.parse import save_config, to_dict
from rl.config.plan import cadence
from rl.config.vocabulary import names_of
from rl.engine.dist import build_accelerator
from rl.engine.optim import build_optimizer, build_scheduler
from rl.engine.pipeline import ForwardBackwardPipeline
from rl.engine.state import (StopSignal, checkpoint_dir, checkpoint_load_error, checkpoint_name, complete_checkpoints,
                             prune_checkpoints, resolve_resume)
from rl.engine.tracking import CallbackTracker, Tracker  # noqa: F401 - CallbackTracker: importable from here
from rl.errors import RunError, disk_full
from rl.models.loading import (
    add_neftune,
    apply_lora,
    configure_tokenizer,
    load_tokenizer,
    load_trainable_policy,
    lora_options,
    release_device_cache,
    resolve_dtype,
    seed_run,
    trainable_fraction,
)
from rl.models.hub import HubPusher
from rl.models.limits import check_length
from rl.models.reference import ReferencePolicy
from rl.models.saving import make_loadable, save_pretrained
from rl.trainers.rewards import RewardModelReward
from rl.trainers.run_dir import check_output_dir  # noqa: F401 - the launch scripts import it from here


# metrics whose non-finite value means the weights are, or are about to be, garbage: the loss and its
# parts (PPO logs loss/policy, loss/value, loss/total) and the gradient norm
def _guarded(key: str) -> bool:
    return key in ("loss", "grad_norm") or key.startswith("loss/")


FIRST_EVAL = "first_eval"  # a checkpoint's copy of the evaluation before the first step


class NonFiniteError(RunError):
    """A loss or gradient norm became NaN or infinite."""


def check_finite(row: dict) -> None:
    """Raise NonFiniteError naming the step and the metric when a guarded value is not finite."""
    for key, v in row.items():
        if _guarded(key) and isinstance(v, (int, float)) and not math.isfinite(v):
            raise NonFiniteError(f"step {row.get('step')}: {key} is {v}; training diverged (lower "
                                 f"learning_rate, or check the data and rewards); nothing was saved at this step")




class _Stop(StopSignal):
    """StopSignal plus Ctrl-C: the first SIGINT asks for a clean stop, a second one aborts."""

    def __init__(self):
        super().__init__((signal.SIGUSR1, signal.SIGTERM, signal.SIGINT))

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt
        super()._handle(signum, frame)


class Trainer:
    """Base of the five trainers. Subclasses set `cfg`, `accelerator` and, before `fit`, `pipeline`."""

    stopped_by: int | None = None  # the signal that stopped the run early, if any
    hub = None  # rl.models.hub.HubPusher of a push_to_hub run (main process)

    # ------------------------------------------------------------------ hooks (the algorithm's own)
    def train_step(self) -> dict:
        raise NotImplementedError

    def evaluate_now(self) -> dict | None:
        return None

    def checkpoint_extra(self) -> dict:
        return {}

    def restore(self, extra: dict) -> None:  # noqa: B027 - optional hook
        pass

    def checkpoint_parts(self, name: str) -> list[Path]:
        """Directories besides `<run_dir>/checkpoints/<name>` that checkpoint `name` consists of (a second
        engine's state, e.g. PPO's critic): cleaned up with it on a full disk and pruned with it."""
        return []

    @property
    def config(self):
        """The trainer's config (the reference docs' name for it)."""
        return self.cfg

    @config.setter
    def config(self, value) -> None:
        self.cfg = value

    @property
    def current_step(self) -> int:
        return self.pipeline.step

    @property
    def run_dir(self) -> Path:
        """Where checkpoints go (`<run_dir>/checkpoints`)."""
        return Path(self.cfg.output_dir)

    def save_checkpoint(self, name: str, extra: dict) -> None:
        self.pipeline.save_state(name, extra)

    # ------------------------------------------------------------------ construction shared by the trainers
    def build(self, config, *, model=None, tokenizer=None, micro_batch_size: int | None = None,
              padding_side: str = "right", rewards: Callable[[], object] | None = None,
              reference: dict | None = None):
        """What every trainer builds, in one order: seed; tokenizer; the reward sources (`rewards()`, before
        the accelerator, so that a reward model is not ZeRO-3 partitioned at load time; it is moved to the
        device after); accelerator; policy (loaded under the accelerator's ZeRO-3 context); the frozen
        reference (`reference`: the keywords of `ReferencePolicy.build`, decided before LoRA, since with
        LoRA the reference is the policy with its adapters off); LoRA; parameter counts. Returns the policy."""
        self.cfg = cfg = config
        seed_run(cfg)
        if cfg.tf32 is not None:  # TRL's tf32: TF32 matmuls on Ampere+ GPUs (no effect on a CPU)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32
        self.tokenizer = tokenizer or configure_tokenizer(load_tokenizer(
            cfg.model_name, cfg.trust_remote_code, padding_side=padding_side, revision=cfg.model_revision), cfg)
        self.reward = rewards() if rewards is not None else None
        self.accelerator = build_accelerator(
            cfg.gradient_accumulation_steps, device=getattr(cfg, "device", None),
            micro_batch_size=micro_batch_size or cfg.per_device_train_batch_size, max_grad_norm=cfg.max_grad_norm,
            mixed_precision="bf16" if resolve_dtype(cfg.dtype) == torch.bfloat16 else "no",
            deepspeed_config=cfg.deepspeed)
        rm = self.reward.find(RewardModelReward) if self.reward is not None else None
        if rm is not None and not getattr(rm.model.config, "quantization", None):
            rm.model.to(self.accelerator.device)
        if model is None:
            model = load_trainable_policy(cfg)
        # a sequence of max_length tokens must fit the model's positions (a learned table has no row past them)
        check_length(cfg.max_length, model, cfg.model_name)
        self.reference = (ReferencePolicy.build(cfg, model, self.accelerator, **reference)
                          if reference is not None else None)
        if self.reference is not None and self.reference.model is not None and reference.get("name"):
            check_length(cfg.max_length, self.reference.model, reference["name"])  # a teacher of its own
        if getattr(cfg, "sync_ref_model", False):
            self.reference.check_sync(self.accelerator, model)
        add_neftune(model, cfg.neftune_noise_alpha)
        if cfg.lora.enabled and not hasattr(model, "disable_adapter"):  # a PEFT model given keeps its adapters
            model = apply_lora(model, **lora_options(cfg.lora))
        self.trainable, self.total_params = trainable_fraction(model)
        self._model, self.pipeline = model, None
        return model

    def open_run(self, total_steps: int, desc: str, plot_keys: list[str] | None = None):
        """The run's tracker (metrics.jsonl, the configured sinks, the progress bar) after the recipe is
        saved beside the outputs (`config.yaml`, main process only). The first run of a trainer object
        follows the launch scripts' rule: an output_dir holding a previous run is refused unless `resume`
        or `overwrite=true` (`check_output_dir`), so two runs never mix in one metrics.jsonl; a later
        `train()` call of the same object continues its own run."""
        cfg, acc = self.cfg, self.accelerator
        if not getattr(self, "_run_opened", False):
            check_output_dir(cfg)
            acc.wait_for_everyone()  # every process has looked before the main one writes
            self._run_opened = True
        if acc.is_main_process:
            save_config(cfg, cfg.output_dir)
        tracker = Tracker(cfg.output_dir, cfg.report_to, cfg.run_name, to_dict(cfg), total_steps, acc.is_main_process,
                          desc=desc, plot_keys=plot_keys)
        # push_to_hub: the uploads of the checkpoints (rl.models.hub; the launch uploads output_dir at the end)
        self.hub = HubPusher(cfg, log=tracker.write) if cfg.push_to_hub and acc.is_main_process else None
        return tracker

    def save(self, out_dir: str | None = None) -> str:
        """Write the final model and tokenizer (LoRA: the PEFT adapter; `save_merged`: also the merged model);
        every process must call it (ZeRO-3 gathers the weights)."""
        out = out_dir or self.cfg.output_dir
        save_pretrained(self.pipeline.model, self.tokenizer, out, self.accelerator, merged=self.cfg.save_merged)
        self.accelerator.wait_for_everyone()
        return out

    def reduce(self, values: dict[str, float], op: str = "mean") -> dict[str, float]:
        """Cross-process reduction of scalar metrics ("mean" or "sum"), in float64; one process: unchanged."""
        if self.world == 1 or not values:
            return dict(values)
        keys = list(values)
        vec = torch.tensor([float(values[k]) for k in keys], device=self.accelerator.device, dtype=torch.float64)
        return dict(zip(keys, self.accelerator.reduce(vec, op).tolist()))

    def reduce_extremes(self, values: dict[str, float]) -> dict[str, float]:
        """Cross-process max of the keys ending in "/max" and min of those ending in "/min"."""
        if self.world == 1 or not values:
            return dict(values)
        keys = list(values)
        vec = torch.tensor([float(values[k]) for k in keys], device=self.accelerator.device, dtype=torch.float64)
        every = self.accelerator.gather(vec[None]).view(self.world, -1)
        return {k: float(every[:, i].max() if k.endswith("/max") else every[:, i].min()) for i, k in enumerate(keys)}

    def build_pipeline(self, model, total_steps: int, micro_batch_size: int, *, learning_rate: float | None = None,
                       ckpt: Path | None = None, warmup_steps: int | None = None) -> ForwardBackwardPipeline:
        """The engine of `model` with the recipe's AdamW, schedule, gradient accumulation and chunked LM
        head; checkpoints in `<run_dir>/checkpoints` unless `ckpt` says otherwise."""
        cfg = self.cfg
        optimizer = build_optimizer(model, cfg.learning_rate if learning_rate is None else learning_rate,
                                    cfg.weight_decay, cfg.optim, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_epsilon,
                                    cfg.optim_args)
        scheduler = build_scheduler(optimizer, cfg.lr_scheduler_type, total_steps, cfg.warmup_ratio,
                                    cfg.warmup_steps if warmup_steps is None else warmup_steps, cfg.lr_scheduler_kwargs)
        return ForwardBackwardPipeline(
            model, gradient_accumulation_steps=cfg.gradient_accumulation_steps, optimizer=optimizer,
            scheduler=scheduler, accelerator=self.accelerator, checkpoint_dir=ckpt or checkpoint_dir(self.run_dir),
            micro_batch_size=micro_batch_size, logprob_chunk_size=cfg.logprob_chunk_size)

    def load_checkpoint(self, path: Path) -> dict:
        return self.pipeline.load_state(path)

    # ------------------------------------------------------------------ derived
    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps per pass over the data when the trainer knows it (the epoch trainers), for the
        'epoch' strategies; None: total steps / num_train_epochs."""
        return None

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def processes(self) -> str:
        """"1 process" / "2 processes" for the run's first line; with GRPO's rollout_processes (outside this
        process's world) "1 training process + 1 rollout (sampling) process"."""
        sampling = getattr(self.cfg, "rollout_processes", 0) or 0
        parts = [(self.world, "training " if sampling else ""), (sampling, "rollout (sampling) ")][:1 + bool(sampling)]
        return " + ".join(f"{n} {kind}process{'es' if n != 1 else ''}" for n, kind in parts)

    # ------------------------------------------------------------------ the lifecycle
    def fit(self, total_steps: int, tracker, eval_at_start: bool = False) -> list[dict]:
        """Run `train_step` until `current_step` reaches `total_steps`; returns the metric rows (a resumed run's
        begin with the evaluation before its first step, when there was one: the summary's "before" figure)."""
        self.stopped_by = None
        resumed = self._resume(tracker)
        history: list[dict] = [dict(self.first_eval)] if resumed and self.first_eval else []
        # a bar with a total for every trainer; the console's elapsed time and ETA count from here
        getattr(tracker, "set_total", lambda *a: None)(total_steps, self.current_step)
        when = cadence(self.cfg, total_steps, self.steps_per_epoch)
        stopper = _Stop()
        mark = [time.time(), getattr(self.pipeline, "tokens_seen", 0)]  # tokens/s since the previous logged row
        try:
            if (eval_at_start or when.eval_start) and when.evaluate and self.current_step == 0:
                ev = self.evaluate_now()
                if ev is not None:
                    self.first_eval = {"step": 0, **ev}  # kept in checkpoints (see above)
                    history.append(dict(self.first_eval))
                    tracker.log(0, ev)
            while self.current_step < total_steps:
                before = self.current_step
                row = self.train_step()
                step = row["step"]
                if self.current_step != before + 1 or step != self.current_step:
                    # the cadence below counts optimizer steps: a trainer must not run several per call
                    raise RuntimeError(f"{type(self).__name__}.train_step went from step {before} to "
                                       f"{self.current_step} (row step {step}); it must take exactly one")
                check_finite(row)
                self._between_steps(step)
                evaluate = when.eval_at(step, total_steps)
                if evaluate or when.log_at(step, total_steps):  # on every process: the count is summed over them
                    row["train_tokens_per_second"] = self._tokens_per_second(mark)
                if evaluate:
                    ev = self.evaluate_now()
                    if ev is None and when.eval and step == when.eval:  # a key without effect: said once
                        tracker.write(f"note: {names_of(type(self.cfg), 'eval_steps')}={self.cfg.eval_steps} evaluates "
                                      f"nothing: this run has no held-out data (data.eval_path, data.eval_fraction) "
                                      f"or eval_env_config")
                    row.update(ev or {})
                history.append(row)
                if when.log_at(step, total_steps) or any(k.startswith("eval") for k in row):
                    tracker.log(step, {k: v for k, v in row.items() if k != "step"})
                stop = stopper.agreed(self.accelerator)
                if when.save_at(self.current_step) or stop:
                    self._checkpoint()
                if stop:
                    self.stopped_by = stopper.received
                    tracker.write(f"stopping on signal {stopper.received} after step {self.current_step}; "
                                  f"checkpoint written, resume with resume=auto")
                    break
            return history
        finally:
            stopper.restore()
            tracker.close()

    def _between_steps(self, step: int) -> None:
        """TRL's per-step extras: the accelerator's cache freed every torch_empty_cache_steps, and TR-DPO's
        reference update every ref_model_sync_steps (sync_ref_model)."""
        cfg = self.cfg
        if cfg.torch_empty_cache_steps and step % cfg.torch_empty_cache_steps == 0:
            release_device_cache()
        if getattr(cfg, "sync_ref_model", False) and step % cfg.ref_model_sync_steps == 0:
            self.reference.sync(self.pipeline.unwrapped_model, cfg.ref_model_mixup_alpha)

    first_eval: dict | None = None  # the evaluation before the first step (step 0), also in every checkpoint

    def _tokens_per_second(self, mark: list) -> float:
        """Tokens through forward-backward on every process per wall second since `mark` ([time, this process's
        count]), which moves to now."""
        now, seen = time.time(), getattr(self.pipeline, "tokens_seen", 0)
        tokens = self.reduce({"n": float(seen - mark[1])}, "sum")["n"]
        rate, mark[:] = tokens / max(now - mark[0], 1e-9), [now, seen]
        return rate

    def _resume(self, tracker) -> bool:
        cfg = self.cfg
        if not cfg.resume:
            return False
        candidates = complete_checkpoints(self.run_dir) if cfg.resume == "auto" else \
            [resolve_resume(cfg.resume, self.run_dir)]
        for i, path in enumerate(candidates):
            try:
                extra = self.load_checkpoint(path)
            except Exception as e:  # noqa: BLE001 - any unreadable file: fall back to an older checkpoint
                if cfg.resume != "auto" or i + 1 == len(candidates):
                    detail, fix = checkpoint_load_error(e)
                    raise RunError(f"resume: checkpoint {path} cannot be loaded ({detail}){fix}") from None
                tracker.write(f"warning: checkpoint {path} cannot be loaded ({type(e).__name__}); "
                              f"trying the previous one")
                continue
            self.restore(extra)
            self.first_eval = extra.get(FIRST_EVAL)
            tracker.write(f"resumed from {path} at step {self.current_step}")
            return True
        return False

    def _checkpoint(self) -> None:
        name = checkpoint_name(self.current_step)
        # from_pretrained's files go in before the rename (written after it, a SIGKILL right after the
        # rename left a complete checkpoint without config.json that from_pretrained could not load)
        self.pipeline.before_commit = lambda tmp: make_loadable(tmp, self.pipeline.unwrapped_model,
                                                                getattr(self, "tokenizer", None))
        try:
            extra = self.checkpoint_extra()
            self.save_checkpoint(name, {**extra, FIRST_EVAL: self.first_eval} if self.first_eval else extra)
        except Exception as e:
            # a full disk, in the words of each writer (an OSError, safetensors' own error, torch.save's
            # RuntimeError: see rl.errors.disk_full); anything else is not ours to explain
            if not disk_full(e):
                raise
            root = checkpoint_dir(self.run_dir)
            for part in (root / name, *self.checkpoint_parts(name)):  # the half-written ones
                shutil.rmtree(part.parent / f".tmp-{part.name}", ignore_errors=True)
            raise RunError(f"no space left on {root} while writing {name}; the previous checkpoint is kept "
                           f"(free space or lower save_total_limit, then resume=auto)") from None
        if self.accelerator.is_main_process:
            prune_checkpoints(self.run_dir, getattr(self.cfg, "save_total_limit", None), self.checkpoint_parts)
            if self.hub is not None:
                self.hub.checkpoint(checkpoint_dir(self.run_dir) / name, self.current_step)
        self.accelerator.wait_for_everyone()

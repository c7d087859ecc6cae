"""The engine's training pipeline: ordered forward-backward / optimizer-step / sampling requests on
one model, on top of Accelerate.

`ForwardBackwardPipeline` keeps the reference's call shapes (requests return futures; `save_state` and
`load_state` return their dicts, as the reference docs show) and fixes what the reference got wrong:

* Requests run in submission order (`rl.engine.futures.RequestQueue`: inline by default, or on ONE
  worker thread with `asynchronous=True`, whatever `max_workers` says), so an `optim_step` always sees
  the gradients of the `forward_backward` calls submitted before it; a failed request whose future
  nobody reads is raised at `shutdown()`.
* Gradients are accumulated over up to N = `gradient_accumulation_steps` micro-batches, each scaled
  by 1/N (by us, or by DeepSpeed in its own backward), synchronised across processes only on the
  N-th micro-batch, and cleared after every optimizer step. An `optim_step` after k < N micro-batches
  (the reference docs queue one with N = 4) rescales the sum by N/k, so it applies the mean gradient
  of the k micro-batches it got, and reports k as `metrics["num_micro_batches"]`. A forward_backward
  beyond the N-th is an error: the docs always step explicitly (the optimizer may be given to
  `optim_step` only), so there is no optimizer to step with automatically.
* The same code runs single-process, DDP and DeepSpeed ZeRO-2/3, because the model and optimizer
  go through `accelerator.prepare` and the backward through `accelerator.backward`.
* `save_state` / `load_state` write and read the checkpoint format of `rl.engine.state` (atomic:
  a crash mid-save leaves the previous checkpoint loadable; nothing is unpickled on load).

Under DeepSpeed the optimizer step happens inside the backward of the last micro-batch (that is how
DeepSpeed works); `optim_step` then only reports the gradient norm and steps the scheduler.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from rl.engine import losses
from rl.engine.chunked import auto_capture_head
from rl.engine.dist import (
    build_accelerator,
    finish_partial_accumulation,
    fit_deepspeed_batch,
    inner_optimizer,
    is_deepspeed,
)
from rl.engine.futures import RequestQueue, SampleFuture
from rl.engine.generation import config_pad_eos, generate, split_stop
from rl.engine.state import (
    check_checkpoint_name,
    load_pipeline_state,
    save_pipeline_state,
)


@dataclass
class ForwardBackwardResult:
    """What one forward(-backward) request produced. `loss` is the unscaled micro-batch loss."""

    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    num_tokens: int = 0
    outputs: Any = None  # per-token tensors for forward(); None for forward_backward


@dataclass
class OptimStepResult:
    """What one optimizer step did. `metrics["num_micro_batches"]`: the micro-batches whose mean
    gradient it applied (`gradient_accumulation_steps`, or fewer after a partial accumulation)."""

    grad_norm: float | None
    step: int
    learning_rate: float | None
    metrics: dict[str, float] = field(default_factory=dict)


class ForwardBackwardPipeline(RequestQueue):
    """Ordered, future-returning forward/backward/optimizer requests on one model.

    Args:
        model: a `torch.nn.Module` whose forward takes `input_ids`/`attention_mask` and returns an
            object with `.logits` (any HF causal LM), not yet prepared by accelerate.
        device: "cpu" forces the CPU; None lets accelerate choose.
        max_workers: accepted for compatibility with the reference; requests never run in
            parallel, so that their order is the submission order.
        asynchronous: run requests on one background worker thread instead of inline in the
            calling thread (see `rl.engine.futures` for why inline is the default).
        gradient_accumulation_steps: micro-batches per optimizer step.
        optimizer, scheduler: optional here; required here under DeepSpeed, which builds its
            engine from model and optimizer together. Elsewhere the optimizer may be passed to the
            first `optim_step` instead.
        accelerator: an existing Accelerator (its accumulation steps must match).
        checkpoint_dir: where `save_state(name)` writes `<checkpoint_dir>/<name>`.
        logprob_chunk_size: positions per chunk of the LM head in the training forward (see
            `rl.engine.chunked`): the loss gets a `HeadLogits` instead of (B, T, V) logits, and
            `rl.engine.losses.token_logprobs` computes the log-probs chunk by chunk, recomputing each
            chunk's logits in backward. None: automatic, chunked once B*T*V exceeds
            `rl.engine.chunked.AUTO_MIN_ELEMENTS`; 0: never.
    """

    def __init__(self, model, device: str | None = None, max_workers: int = 1,
                 gradient_accumulation_steps: int = 1, *, optimizer=None, scheduler=None,
                 accelerator=None, checkpoint_dir: str | os.PathLike = "checkpoints",
                 micro_batch_size: int | None = None, max_grad_norm: float | None = None,
                 asynchronous: bool = False, logprob_chunk_size: int | None = None):
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        if accelerator is None:
            accelerator = build_accelerator(gradient_accumulation_steps, device,
                                            micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm)
        elif is_deepspeed(accelerator):
            fit_deepspeed_batch(accelerator, gradient_accumulation_steps, micro_batch_size)
        self.accelerator = accelerator
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.logprob_chunk_size = logprob_chunk_size
        self.checkpoint_dir = Path(checkpoint_dir)
        self.max_workers = max_workers
        self.optimizer = None
        self.scheduler = None
        if optimizer is not None:
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
            # The scheduler stays ours: accelerate's wrapper steps it once per process per call.
            self.scheduler = scheduler
        elif is_deepspeed(accelerator):
            raise ValueError("under DeepSpeed, pass optimizer= (and scheduler=) to ForwardBackwardPipeline: "
                             "DeepSpeed builds its engine from the model and optimizer together")
        else:
            self.model = accelerator.prepare(model)
        self.step = 0  # optimizer steps taken
        self.micro_step = 0  # micro-batches since the last optimizer step
        self.tokens_seen = 0  # tokens (attended positions) through forward-backward on this process, for tokens/s
        self.before_commit: Callable[[Path], None] | None = None  # rl.engine.state.save_pipeline_state calls it
        self.loss_fns: dict[str, Callable] = dict(losses.LOSS_FNS)
        super().__init__(asynchronous=asynchronous)  # the request queue: submit, shutdown

    # ------------------------------------------------------------------ plumbing
    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def unwrapped_model(self):
        return self.accelerator.unwrap_model(self.model)

    def _to_device(self, t):
        if t is None:
            return None
        if not torch.is_tensor(t):
            t = torch.as_tensor(t)
        return t.to(self.device)

    def _backward(self, loss: torch.Tensor) -> None:
        """Accumulate 1/N of this micro-batch's gradient; synchronise only on the N-th (a partial
        accumulation is finished by `rl.engine.dist.finish_partial_accumulation`).

        We keep our own micro-batch counter instead of `accelerator.accumulate`: accelerate's
        gradient state is a process-wide singleton, so a second pipeline (a reward model, a
        critic) with another accumulation count would silently change this one's scaling."""
        last = self.micro_step + 1 == self.gradient_accumulation_steps
        acc = self.accelerator
        if is_deepspeed(acc):
            engine = self.model  # DeepSpeed scales by 1/N itself and steps at the boundary
            engine.set_gradient_accumulation_boundary(is_boundary=last)
            engine.backward(loss)
            if last:
                engine.step()
        else:
            scaled = loss / self.gradient_accumulation_steps
            with nullcontext() if last else acc.no_sync(self.model):
                if acc.scaler is not None:
                    acc.scaler.scale(scaled).backward()
                else:
                    scaled.backward()
        self.micro_step += 1

    # ------------------------------------------------------------------ requests
    def forward_backward(self, input_ids, attention_mask=None, labels=None,
                         loss_fn: str | Callable = "cross_entropy", *, model_inputs: dict | None = None,
                         defer_head: bool = False, **loss_kwargs) -> Future:
        """Forward + loss + backward on one micro-batch; returns Future[ForwardBackwardResult].

        `loss_fn` names a built-in loss (see `rl.engine.losses.LOSS_FNS`) or is a callable
        `(logits, labels, attention_mask, **loss_kwargs) -> (loss, metrics)`. `labels` follow the
        HF convention (same length as `input_ids`, -100 = ignored; the shift happens inside).
        `position_ids=` (a keyword) goes to the model; with it and no `attention_mask` the row is a
        packed one (`rl.engine.packing.pack_examples`) and the model gets no mask either.
        `model_inputs`: more keyword tensors for the model's forward (`rl.engine.segments`' boundaries).
        `defer_head`: the loss gets a `HeadLogits` at any size unless `logprob_chunk_size` is 0 (`rl.engine.fused_head`).
        """
        return self.submit(self._forward_backward, input_ids, attention_mask, labels, loss_fn, loss_kwargs,
                           model_inputs or {}, defer_head)

    def _forward_backward(self, input_ids, attention_mask, labels, loss_fn, loss_kwargs, model_inputs, defer_head):
        if isinstance(loss_fn, str) and loss_fn not in self.loss_fns:
            raise KeyError(f"unknown loss_fn {loss_fn!r}; built-in: {', '.join(self.loss_fns)}")
        fn = self.loss_fns[loss_fn] if isinstance(loss_fn, str) else loss_fn
        self._check_accumulation_room()
        input_ids = self._to_device(input_ids)
        # position_ids without a mask: a packed row (rl.engine.packing); the model gets no mask, so that it
        # builds the block-diagonal causal mask from the position ids
        # `position_ids` is a model input, not a loss input (left-padded rollouts need it on models
        # with absolute positions, so training scores tokens as they were sampled)
        model_kw = {k: self._to_device(v) for k, v in model_inputs.items()}
        if loss_kwargs.get("position_ids") is not None:
            model_kw["position_ids"] = self._to_device(loss_kwargs["position_ids"])
        loss_kwargs = {k: v for k, v in loss_kwargs.items() if k != "position_ids"}
        packed = attention_mask is None and model_kw.get("position_ids") is not None
        attention_mask = self._to_device(attention_mask) if attention_mask is not None else torch.ones_like(input_ids)
        labels = self._to_device(labels) if labels is not None else input_ids.masked_fill(attention_mask == 0, -100)
        kwargs = {k: self._to_device(v) if torch.is_tensor(v) else v for k, v in loss_kwargs.items()}
        self.model.train()
        with self.head_capture(input_ids, always=defer_head):
            outputs = self.model(input_ids=input_ids, attention_mask=None if packed else attention_mask,
                                 use_cache=False, **model_kw)
        loss, metrics = fn(outputs.logits, labels, attention_mask, **kwargs)
        self._backward(loss)
        self.tokens_seen += int(attention_mask.sum())
        n = int((labels[:, 1:] != -100).sum())
        return ForwardBackwardResult(loss=float(loss.detach()), metrics=_floats(metrics), num_tokens=n)

    def forward_backward_custom(self, custom_loss_fn: Callable, input_ids, attention_mask=None,
                                model_inputs: dict | None = None, defer_head: bool = False, **kwargs) -> Future:
        """Backward through `custom_loss_fn(model, inputs, outputs, **kwargs) -> scalar loss`.

        The loss may also be returned as `(loss, metrics)`. The next `optim_step` applies it
        like any other micro-batch (the reference made it a no-op). `model_inputs`: more keyword
        tensors for the model's forward; with `position_ids` among them and no `attention_mask` the
        rows are packed ones (`rl.engine.packing`) and the model gets no mask, as in `forward_backward`
        (`defer_head` too)."""
        return self.submit(self._forward_backward_custom, custom_loss_fn, input_ids, attention_mask,
                           model_inputs or {}, kwargs, defer_head)

    def _forward_backward_custom(self, custom_loss_fn, input_ids, attention_mask, model_inputs, kwargs, defer_head):
        self._check_accumulation_room()
        input_ids = self._to_device(input_ids)
        packed = attention_mask is None and model_inputs.get("position_ids") is not None
        attention_mask = self._to_device(attention_mask) if attention_mask is not None else torch.ones_like(input_ids)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  **{k: self._to_device(v) for k, v in model_inputs.items()}}
        self.model.train()
        call = {**inputs, "attention_mask": None} if packed else inputs  # the loss still sees the 1s mask
        with self.head_capture(input_ids, always=defer_head):
            outputs = self.model(**call, use_cache=False)
        out = custom_loss_fn(self.model, inputs, outputs, **kwargs)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise ValueError("custom_loss_fn must return a scalar tensor (or (scalar, metrics))")
        self._backward(loss)
        self.tokens_seen += int(attention_mask.sum())
        return ForwardBackwardResult(loss=float(loss.detach()), metrics=_floats(metrics),
                                     num_tokens=int(attention_mask.sum()))

    def head_capture(self, input_ids: torch.Tensor, always: bool = False):
        """The context of a forward of this model: the LM head deferred to the loss, chunk by chunk
        (`rl.engine.chunked.capture_head`), when `logprob_chunk_size` is set or the logits would be large
        (`always`: at any size unless it is 0). The engine's training forwards use it; a trainer's own may too."""
        return auto_capture_head(self.model, input_ids, self.logprob_chunk_size, always=always)

    def _check_accumulation_room(self) -> None:
        if self.micro_step >= self.gradient_accumulation_steps:
            raise RuntimeError(
                f"{self.micro_step} micro-batches were accumulated but gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}; call optim_step before the next forward_backward")

    def optim_step(self, optimizer=None, scheduler=None, max_grad_norm: float | None = None) -> Future:
        """Clip, step the optimizer and scheduler, clear gradients; Future[OptimStepResult].

        Applies the mean gradient of the k micro-batches accumulated since the last step, 1 <= k <=
        `gradient_accumulation_steps` (k is `metrics["num_micro_batches"]`). k = 0 is an error (there
        is no gradient), and so is k < N under DeepSpeed, which steps inside the N-th backward."""
        return self.submit(self._optim_step, optimizer, scheduler, max_grad_norm)

    def _optim_step(self, optimizer, scheduler, max_grad_norm):
        acc = self.accelerator
        k, n = self.micro_step, self.gradient_accumulation_steps
        if k == 0:
            raise RuntimeError("optim_step after 0 forward_backward calls since the last step: there is no "
                               "gradient to apply; queue a forward_backward first")
        if k < n and is_deepspeed(acc):
            raise RuntimeError(
                f"optim_step after {k} forward_backward calls, but gradient_accumulation_steps={n}: under "
                f"DeepSpeed the step happens inside the backward of the last micro-batch, so queue {n} "
                f"micro-batches per step or lower gradient_accumulation_steps")
        self._adopt(optimizer, scheduler)
        if self.optimizer is None:
            raise ValueError("optim_step needs an optimizer (pass it here or to the pipeline)")
        if k < n:
            finish_partial_accumulation(self.model, self.accelerator, k, n)
        grad_norm = None
        inner = inner_optimizer(self.optimizer)
        if is_deepspeed(acc):
            # DeepSpeed clipped, stepped and cleared the gradients inside the last backward.
            grad_norm = self.model.get_global_grad_norm()
        else:
            if max_grad_norm is not None and max_grad_norm > 0:
                grad_norm = acc.clip_grad_norm_(self.model.parameters(), max_grad_norm)  # unscales fp16
            else:
                grads = [p.grad.detach().float().norm() for p in self.model.parameters() if p.grad is not None]
                grad_norm = torch.stack(grads).norm() if grads else 0.0
            if acc.scaler is not None:
                acc.scaler.step(inner)
                acc.scaler.update()
            else:
                inner.step()
            inner.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.micro_step = 0
        self.step += 1
        lr = inner.param_groups[0]["lr"] if inner.param_groups else None
        return OptimStepResult(grad_norm=None if grad_norm is None else float(grad_norm),
                               step=self.step, learning_rate=lr, metrics={"num_micro_batches": k})

    def _adopt(self, optimizer, scheduler) -> None:
        """Prepare an optimizer/scheduler handed to optim_step (allowed outside DeepSpeed)."""
        if optimizer is not None and self.optimizer is None:
            self.optimizer = self.accelerator.prepare_optimizer(optimizer)
        elif optimizer is not None and inner_optimizer(optimizer) is not inner_optimizer(self.optimizer):
            raise ValueError("optim_step got a different optimizer from the one already in use")
        if scheduler is not None and self.scheduler is None:
            self.scheduler = scheduler

    def forward(self, input_ids, attention_mask=None, labels=None, model=None) -> Future:
        """No-grad forward; Future[ForwardBackwardResult] whose `outputs` holds per-token log-probs
        of `labels` (or of the inputs themselves), shape (B, T-1), zero where masked."""
        return self.submit(self._forward, input_ids, attention_mask, labels, model)

    @torch.no_grad()
    def _forward(self, input_ids, attention_mask, labels, model=None):
        model = model or self.model
        input_ids = self._to_device(input_ids)
        attention_mask = self._to_device(attention_mask) if attention_mask is not None else torch.ones_like(input_ids)
        labels = self._to_device(labels) if labels is not None else input_ids.masked_fill(attention_mask == 0, -100)
        was_training = model.training
        model.eval()
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        model.train(was_training)
        logp, mask = losses.token_logprobs(logits, labels)
        nll = -(logp * mask).sum() / mask.sum().clamp(min=1)
        return ForwardBackwardResult(loss=float(nll), num_tokens=int(mask.sum()), outputs=logp * mask)

    # ------------------------------------------------------------------ sampling
    def sample(self, prompt, max_tokens: int = 100, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, stop=None, num_samples: int = 1, seed: int | None = None,
               tokenizer=None) -> "SampleFuture":
        """Sample from the current policy after one prompt (token list or 1-D tensor), in order.

        `stop` mixes token ids and strings (strings need `tokenizer`); the model's EOS always stops.
        Returns a future that also reads like the reference's dict: `samples["tokens"]`,
        `samples["logprobs"]` (per-token, of the distribution sampled from, after temperature /
        top-k / top-p) and `samples["prompt"]`; lists of lists when num_samples > 1. Under ZeRO-3
        call it on every rank (the parameters are gathered once for the rollout)."""
        return self._submit(SampleFuture(), self._sample, prompt, max_tokens, temperature, top_k, top_p, stop,
                            num_samples, seed, tokenizer)

    def _sample(self, prompt, max_tokens, temperature, top_k, top_p, stop, num_samples, seed, tokenizer):
        ids, strings = split_stop(stop)
        if torch.is_tensor(prompt):
            prompt = prompt.reshape(-1).tolist()
        out = self._rollout([list(map(int, prompt))], max_new_tokens=max_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, stop_token_ids=ids, stop_strings=strings,
                            seed=seed, num_samples=num_samples, tokenizer=tokenizer)
        return out.sample_dict(flat=num_samples == 1)

    def sample_batch(self, prompts, tokenizer=None, **generate_kwargs) -> Future:
        """Batched rollout of many prompts; Future[rl.engine.generation.Rollout] (see `rl.engine.generation.generate`)."""
        return self.submit(self._rollout, prompts, tokenizer=tokenizer, **generate_kwargs)

    def _rollout(self, prompts, tokenizer=None, **kw):
        tok_or_pad = tokenizer if tokenizer is not None else getattr(self, "tokenizer", None)
        if tok_or_pad is None:
            tok_or_pad, eos = config_pad_eos(self.unwrapped_model)
            kw.setdefault("eos_token_id", eos)
        return generate(self.model, tok_or_pad, prompts, **kw)

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, name: str, extra_state: dict | None = None) -> dict:
        """Write `<checkpoint_dir>/<name>` atomically, after every request queued before it; returns
        the reference's dict `path`, `model_path`, `optimizer_path`, `state_path` (blocking, as
        documented; `AsyncTrainingClient.save_state` returns a future). Call it on every process.

        `name` is one path component (`check_checkpoint_name`): ValueError before anything is written."""
        check_checkpoint_name(name)
        return self.submit(self._save_state, name, extra_state or {}).result()

    def _save_state(self, name: str, extra_state: dict) -> dict:
        return save_pipeline_state(self, name, extra_state)

    def load_state(self, path: str | os.PathLike) -> dict:
        """Restore what `save_state` wrote, after every request queued before it; returns the
        `extra_state` dict saved with it (blocking; `AsyncTrainingClient.load_state` returns a future)."""
        return self.submit(self._load_state, Path(path)).result()

    def _load_state(self, path: Path) -> dict:
        return load_pipeline_state(self, path)


def _floats(metrics: dict) -> dict[str, float]:
    """A loss's metrics (tensors or numbers) as plain floats."""
    return {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in (metrics or {}).items()}

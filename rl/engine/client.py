"""The training client of the reference docs: `AsyncTrainingClient` (imported there from
`rl.forward_backward`), every call a future, on one `ForwardBackwardPipeline`.

It runs the pipeline on its worker thread (`asynchronous=True`, see `rl.engine.futures`) and speaks in
batch dicts: `input_ids`, `attention_mask`, `labels` go to the model, every other key (advantages,
old_logprobs, returns, weights, ...) to the loss. For a left-padded batch it passes position ids
counted from each row's first attended token, as in sampling, so training scores tokens as they were
sampled. An optional frozen reference model (placed by `rl.engine.dist.place_frozen`: under ZeRO-3
its own DeepSpeed inference engine) serves `forward(batch, use_reference=True)`, scored with the LM
head chunked (`rl.engine.scoring.sequence_logprobs`). Unlike the pipeline's, its `save_state` and
`load_state` return futures; the reference model is not saved.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch

from rl.engine.dist import place_frozen
from rl.engine.futures import SampleFuture
from rl.engine.pipeline import ForwardBackwardPipeline, ForwardBackwardResult
from rl.engine.scoring import sequence_logprobs
from rl.engine.state import check_checkpoint_name

BATCH_MODEL_KEYS = ("input_ids", "attention_mask", "labels")


class AsyncTrainingClient:
    """Tinker-style training client: every call returns a future; calls run in submission order.

    Built on one `ForwardBackwardPipeline` (one worker thread), so an `optim_step` submitted after
    a `forward_backward` always sees its gradients, and an exception in a request is raised by that
    request's `.result()` while later requests still run.

    Args:
        model: the policy (an HF causal LM, not yet prepared).
        reference_model: optional frozen model for `forward(batch, use_reference=True)`. Under
            ZeRO-3 it becomes its own DeepSpeed inference engine (the policy's config without
            optimizer/scheduler), so each rank holds a shard of it; otherwise it is moved to the
            device, frozen and kept in eval mode.
        device, gradient_accumulation_steps, **pipeline_kwargs: as `ForwardBackwardPipeline`
            (optimizer=, scheduler=, accelerator=, checkpoint_dir=, micro_batch_size=, ...).
        tokenizer: optional; gives pad/EOS ids and enables stop strings in `sample`.
        logprob_chunk_size: positions per chunk of the LM head in `forward` and `forward_backward`
            (no (B, T, V) logits; see `rl.engine.chunked`); None: automatic above a size threshold, 0: never.

    A batch is a dict with `input_ids` and optionally `attention_mask`, `labels`; any other keys
    (advantages, old_logprobs, returns, weights, ...) are passed to the loss function.
    """

    def __init__(self, model, reference_model=None, device: str | None = None,
                 gradient_accumulation_steps: int = 1, *, tokenizer=None, logprob_chunk_size: int | None = None,
                 **pipeline_kwargs):
        pipeline_kwargs.setdefault("asynchronous", True)
        self.pipeline = ForwardBackwardPipeline(model, device=device,
                                                gradient_accumulation_steps=gradient_accumulation_steps,
                                                logprob_chunk_size=logprob_chunk_size, **pipeline_kwargs)
        self.pipeline.tokenizer = tokenizer
        self.tokenizer = tokenizer
        self.logprob_chunk_size = logprob_chunk_size
        self.reference_model = None if reference_model is None else self._prepare_reference(reference_model)

    # ------------------------------------------------------------------ setup
    @property
    def accelerator(self):
        return self.pipeline.accelerator

    @property
    def model(self):
        return self.pipeline.model

    @property
    def unwrapped_model(self):
        return self.pipeline.unwrapped_model

    @property
    def step(self) -> int:
        return self.pipeline.step

    def _prepare_reference(self, ref):
        for p in ref.parameters():
            p.requires_grad_(False)
        return place_frozen(ref, self.accelerator)

    # ------------------------------------------------------------------ requests
    def forward_backward(self, batch: dict, loss_fn: str | Callable = "cross_entropy", **loss_kwargs) -> Future:
        """Future[ForwardBackwardResult]: forward + loss + backward of one micro-batch."""
        model_in, extra = _split_batch(batch)
        clash = set(extra) & set(loss_kwargs)
        if clash:
            raise ValueError(f"{', '.join(sorted(clash))} given both in the batch and as keyword arguments")
        if "position_ids" not in extra and "position_ids" not in loss_kwargs:
            pos = _left_pad_positions(model_in.get("attention_mask"), self.unwrapped_model)
            if pos is not None:
                extra["position_ids"] = pos
        return self.pipeline.forward_backward(model_in["input_ids"], model_in.get("attention_mask"),
                                              model_in.get("labels"), loss_fn=loss_fn, **extra, **loss_kwargs)

    def forward_backward_custom(self, batch: dict, custom_loss_fn: Callable, **kwargs) -> Future:
        """Future[ForwardBackwardResult] of `custom_loss_fn(model, inputs, outputs, **kwargs)`."""
        model_in, extra = _split_batch(batch)
        return self.pipeline.forward_backward_custom(custom_loss_fn, model_in["input_ids"],
                                                     model_in.get("attention_mask"), **extra, **kwargs)

    def optim_step(self, optimizer=None, scheduler=None, max_grad_norm: float | None = None) -> Future:
        """Future[OptimStepResult]: the mean gradient of the 1..`gradient_accumulation_steps`
        micro-batches queued since the last step (see `ForwardBackwardPipeline.optim_step`)."""
        return self.pipeline.optim_step(optimizer, scheduler, max_grad_norm)

    def forward(self, batch: dict, use_reference: bool = False) -> Future:
        """Future[ForwardBackwardResult] whose `outputs` are per-token log-probs (B, T-1) of the
        batch's labels (or its attended tokens), 0 where masked; no gradients. Position ids are
        counted from each row's first attended token, as in sampling."""
        model_in, _ = _split_batch(batch)
        return self.pipeline.submit(self._forward, model_in, use_reference)

    @torch.no_grad()
    def _forward(self, model_in: dict, use_reference: bool):
        if use_reference and self.reference_model is None:
            raise ValueError("forward(use_reference=True) needs AsyncTrainingClient(reference_model=...)")
        model = self.reference_model if use_reference else self.pipeline.model
        dev = self.pipeline.device
        input_ids = self.pipeline._to_device(model_in["input_ids"])
        mask = model_in.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else self.pipeline._to_device(mask)
        labels = model_in.get("labels")
        labels = None if labels is None else self.pipeline._to_device(labels)
        was_training = model.training
        model.eval()
        try:
            logp, m = sequence_logprobs(model, input_ids.to(dev), mask, labels, chunk_size=self.logprob_chunk_size)
        finally:
            model.train(was_training)
        nll = -(logp * m).sum() / m.sum().clamp(min=1)
        return ForwardBackwardResult(loss=float(nll), num_tokens=int(m.sum()), outputs=logp)

    def sample(self, prompt, max_tokens: int = 100, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               stop=None, num_samples: int = 1, seed: int | None = None) -> SampleFuture:
        """Future of {"tokens", "logprobs", "prompt"} for one prompt; see `ForwardBackwardPipeline.sample`."""
        return self.pipeline.sample(prompt, max_tokens, temperature, top_k, top_p, stop, num_samples, seed,
                                    tokenizer=self.tokenizer)

    def sample_batch(self, prompts, **generate_kwargs) -> Future:
        """Future[rl.engine.generation.Rollout] for many prompts (keyword arguments of `rl.engine.generation.generate`)."""
        return self.pipeline.sample_batch(prompts, tokenizer=self.tokenizer, **generate_kwargs)

    def save_state(self, name: str, extra_state: dict | None = None) -> Future:
        """Future[dict] (`path`, `model_path`, `optimizer_path`, `state_path`): checkpoint the policy,
        optimizer, scheduler and RNG (the frozen reference is not saved). A `name` that is not one
        path component raises ValueError here, before anything is queued or written."""
        check_checkpoint_name(name)
        return self.pipeline.submit(self.pipeline._save_state, name, extra_state or {})

    def load_state(self, path) -> Future:
        """Future[dict] of the `extra_state` saved with the checkpoint at `path`."""
        return self.pipeline.submit(self.pipeline._load_state, Path(path))

    def shutdown(self, wait: bool = True) -> None:
        """Finish the queued requests; raise (and log) failures whose futures were never read."""
        self.pipeline.shutdown(wait=wait)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.shutdown()
        else:  # an exception is already on its way: log unread failures, do not mask it
            self.pipeline.shutdown_logging_unread()


def _left_pad_positions(mask, model):
    """Position ids counted from each row's first attended token, when the batch is left-padded and
    the model takes `position_ids` (as in sampling); None otherwise (the model's default is right)."""
    if mask is None:
        return None
    mask = torch.as_tensor(mask)
    if not bool((mask[:, 0] == 0).any()):
        return None
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if "position_ids" not in params:
        return None
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _split_batch(batch: dict) -> tuple[dict, dict]:
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError("batch must be a dict with 'input_ids' (and optionally 'attention_mask', 'labels', "
                         "plus loss inputs such as 'advantages', 'old_logprobs')")
    model_in = {k: batch[k] for k in BATCH_MODEL_KEYS if batch.get(k) is not None}
    extra = {k: v for k, v in batch.items() if k not in BATCH_MODEL_KEYS}
    return model_in, extra

"""One reference policy for DPO, GRPO and PPO: the frozen model a KL term or a DPO log-ratio is
measured against. Each trainer decides it once with `ReferencePolicy.build` and runs its forwards
through `with reference.use(pipeline) as model:`.

Modes, cheapest first:
  none      no reference (DPO reference_free / ORPO, GRPO beta = 0): no memory, no forward
  adapters  a LoRA policy with its adapters switched off is the base model: no second copy
  copy      a frozen model: `name` when given, else the initial policy. It is deep-copied before LoRA is
            applied, or loaded again by name under ZeRO-3, where the policy's parameters are already
            partitioned and a copy would be empty.
DPO's fourth mode, precomputed log-probs, runs `adapters` or `copy` once over the data and then
`release()`s the model.

One placement rule (`rl.engine.dist.place_frozen`): under ZeRO-3 the reference is its own DeepSpeed
inference engine, each rank holding a shard; otherwise a plain module on the device. One dtype rule: a
copied or loaded reference is kept in the policy's compute dtype (`cfg.dtype`: bf16 when training in bf16,
else fp32: half the memory of fp32 weights, the same matmuls as the policy's autocast) and its forward
runs under the accelerator's autocast like the policy's.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from rl.engine.dist import place_frozen, zero_stage
from rl.errors import ConfigError
from rl.models.loading import freeze, load_causal_lm, resolve_dtype

MODES = ("none", "adapters", "copy")


def _adapter_owner(module):
    """The PEFT model (the object with `disable_adapter()`) in `module` or its `base_model` (PPO's
    policy wraps the PEFT model next to its value head), or None."""
    for m in (module, getattr(module, "base_model", None)):
        if m is not None and hasattr(m, "disable_adapter"):
            return m
    return None


class ReferencePolicy:
    def __init__(self, mode: str, model=None, description: str = ""):
        if mode not in MODES:
            raise ValueError(f"reference mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.model, self.description = mode, model, description
        self._placed = False

    @classmethod
    def build(cls, cfg, policy, accelerator, *, needed: bool = True, name: str | None = None,
              model=None) -> ReferencePolicy:
        """Decide the reference of a run. Call it before LoRA is applied to `policy` (a copy must be the
        initial weights without adapters). `name`: an explicit reference model (recipe key); `model`: one
        passed by the caller. With LoRA on (or a PEFT `policy`) and neither given, the adapters are the
        difference, so switching them off gives the reference for free."""
        if not needed:
            return cls("none", description="none")
        lora = cfg.lora.enabled or _adapter_owner(policy) is not None
        if model is None and name is None and lora:
            return cls("adapters", description="policy without adapters")
        dtype = resolve_dtype(cfg.dtype)
        if model is None:
            if name is not None or zero_stage(accelerator) == 3:
                model = load_causal_lm(name or cfg.model_name, dtype=dtype, trust_remote_code=cfg.trust_remote_code,
                                       attn_implementation=cfg.attn_implementation,
                                       revision=None if name else getattr(cfg, "model_revision", None))
            else:
                model = copy.deepcopy(policy)
        return cls("copy", freeze(model.to(dtype)), description=name or "frozen copy of the initial policy")

    def check_sync(self, accelerator, policy) -> None:
        """Refuse sync_ref_model (TR-DPO) where there is no reference weights to mix into: no reference (GRPO with
        beta 0), LoRA's reference (the policy without adapters: its base weights are not trained), ZeRO-3 (the
        reference is a sharded engine of its own)."""
        if self.mode != "copy":
            raise ConfigError(f"sync_ref_model mixes the policy into a reference model, and this run's reference is "
                              f"{self.description}; set sync_ref_model=false")
        if zero_stage(accelerator) == 3:
            raise ConfigError("sync_ref_model is not supported under ZeRO-3 (the reference is sharded as an engine of "
                              "its own); set sync_ref_model=false")
        if [p.shape for p in self.model.parameters()] != [p.shape for p in policy.parameters()]:
            raise ConfigError(f"sync_ref_model mixes the policy into the reference, and {self.description} is not the "
                              f"policy's architecture; set sync_ref_model=false")

    @torch.no_grad()
    def sync(self, policy, alpha: float) -> None:
        """TR-DPO's update (Gorbatovski et al. 2024; TRL's SyncRefModelCallback): ref <- alpha policy + (1 - alpha)
        ref, parameter by parameter."""
        for ref, new in zip(self.model.parameters(), policy.parameters(), strict=True):
            ref.mul_(1.0 - alpha).add_(new.detach().to(ref.dtype), alpha=alpha)

    @property
    def exists(self) -> bool:
        return self.mode != "none"

    def place(self, accelerator) -> None:
        """Move a `copy` reference where the policy runs (once the accelerator and policy are set up)."""
        if self.mode == "copy" and not self._placed:
            self.model = place_frozen(self.model, accelerator)
            self._placed = True

    def release(self) -> None:
        """Drop the frozen model (after its log-probs were precomputed): no reference in memory."""
        self.model = None
        self.mode = "none"

    @contextlib.contextmanager
    def use(self, pipeline):
        """The module whose forward gives the reference's logits, in eval mode, without gradients:
        the frozen copy, or the pipeline's (prepared) policy with its adapters off."""
        if self.mode == "none":
            raise RuntimeError("this run has no reference model")
        acc = pipeline.accelerator
        if self.mode == "copy":
            self.place(acc)
            with torch.no_grad(), acc.autocast():
                yield self.model
            return
        model = pipeline.model
        owner = _adapter_owner(pipeline.unwrapped_model)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), owner.disable_adapter():
                yield model
        finally:
            model.train(was_training)

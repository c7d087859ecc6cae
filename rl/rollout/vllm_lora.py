"""A LoRA policy's adapters alone into a colocated vLLM engine (`vllm_sync_lora_adapters=true`): the engine serves
the base model with the adapter applied by vLLM's own LoRA support (its punica kernels; the CPU build has them),
and after each optimizer step only the adapter's matrices travel, not the merged weights.

How an adapter gets into stock vLLM: vLLM loads LoRA adapters from a directory (`LoRARequest(name, id, path)`), so
each sync writes the adapter (PEFT's file names and layout: adapter_model.safetensors, adapter_config.json) into a
directory of this process's own (in /dev/shm where it exists: memory, not disk), and the next request asks vLLM to
load it again in place (`load_inplace=True`, same id); later requests of the same version use the loaded one.
The base weights are the engine's own (the model it started on, which a LoRA run does not train); the first
sync also loads the policy's base weights into it, so an engine shared with an earlier trainer serves this one's
base. Measured on the CPU build (tests/integration/test_vllm.py): the engine's log-probs equal the merged path's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from rl.engine.dist import is_zero3
from rl.engine.weight_sync import policy_module
from rl.errors import ConfigError

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 takes


def engine_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM takes that holds adapters of rank `rank`."""
    for r in LORA_RANKS:
        if r >= rank:
            return r
    raise ConfigError(f"vllm_sync_lora_adapters: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}, the policy's is "
                      f"{rank}; lower lora.rank or drop the key (the merged weights are synced then)")


def adapter_state(model) -> tuple[dict[str, torch.Tensor], dict]:
    """The policy's active adapter as PEFT saves it: (tensors under PEFT's file names, the adapter config as plain
    data). Under ZeRO-3 the adapter's parameters are gathered (every rank calls this: a collective)."""
    from peft import get_peft_model_state_dict

    peft = policy_module(model)
    if not hasattr(peft, "peft_config"):
        raise ConfigError("vllm_sync_lora_adapters needs a LoRA policy (lora.enabled=true)")
    own = {n: p for n, p in peft.named_parameters() if ".lora_" in n}
    if is_zero3(peft):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(own.values()), modifier_rank=None):
            copies = {n: p.detach().clone() for n, p in own.items()}
    else:
        copies = {n: p.detach() for n, p in own.items()}
    name = peft.active_adapter if isinstance(peft.active_adapter, str) else peft.active_adapter[0]
    tensors = get_peft_model_state_dict(peft, state_dict=copies, adapter_name=name)
    config = peft.peft_config[name].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}  # sets are not JSON
    return tensors, config


class AdapterSlot:
    """This process's adapter directory and the vLLM request that names it."""

    LORA_ID = 1  # one adapter per engine (max_loras=1): the policy's

    def __init__(self):
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.path = tempfile.mkdtemp(prefix="rl-vllm-adapter-", dir=base)
        self.fresh = False  # a newer adapter is written than the engine has loaded

    def write(self, tensors: dict[str, torch.Tensor], config: dict) -> None:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                  os.path.join(self.path, "adapter_model.safetensors"))
        with open(os.path.join(self.path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        self.fresh = True

    def request(self):
        """The LoRARequest of the next engine call: loaded again in place when a newer adapter was written."""
        from vllm.lora.request import LoRARequest

        req = LoRARequest("policy", self.LORA_ID, self.path, load_inplace=self.fresh)
        self.fresh = False
        return req

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

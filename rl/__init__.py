"""RL fine-tuning for language models on Accelerate and DeepSpeed.

Public names are imported lazily (so `import rl` stays fast and a trainer's heavy imports happen only
when it is used). The table below is the whole public surface; it follows the reference docs.
"""

from __future__ import annotations

import importlib
import logging

from rl.trainers.registry import exports as _trainer_exports

__version__ = "0.1.0"


# Libraries' log lines that are noise in every run of ours (logger -> a text in the line), filtered from `import rl`
# on (the libraries log them at their own import, which comes later):
# * bitsandbytes 0.50 tries a hub kernel at import on CPUs with AVX-512 bf16 (kernels-community's optional 4-bit
#   inference speed-up; it falls back to its own kernel) and logs "Skipping publisher trust check for
#   'kernels-community/...'" and "Failed to load CPU gemm_4bit_forward from kernels-community ... pip install
#   kernels"; we never download it (peft imports bitsandbytes at its own import).
# * DeepSpeed logs "[WARNING] ... Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
#   detect it." at every import where torch sees no GPU either: a warning in every CPU run, the reference docs'
#   examples included, that asks nothing of the user.
_NOISE = {"bitsandbytes.backends.cpu.ops": "kernels-community", "kernels._internals.hf_hub": "kernels-community",
          "DeepSpeed": "Setting accelerator to CPU."}


class _Noise(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


for _name, _text in _NOISE.items():
    logging.getLogger(_name).addFilter(_Noise(_text))
del _name, _text

_EXPORTS = {
    # engine and client
    "ForwardBackwardPipeline": "rl.engine.pipeline",
    "AsyncTrainingClient": "rl.engine.client",
    # config
    "ConfigError": "rl.errors",
    # the reference CLI doc's Python API (rl-train from Python)
    "LLMTrainingParams": "rl.scripts.autotrain",
    "AutoTrainProject": "rl.scripts.autotrain",
    "PPOModel": "rl.models.value",
    "ValueHead": "rl.models.value",
    "AdaptiveKLController": "rl.algos.kl",
    "FixedKLController": "rl.algos.kl",
    # preference data (DPO, reward models)
    "PreferenceDataset": "rl.data.preference",
    # reward models
    "RewardModel": "rl.models.reward",
    "RewardModelConfig": "rl.models.reward",
    "PairwiseRewardModel": "rl.models.reward",
    "MultiObjectiveRewardModel": "rl.models.reward",
    # environments
    "Observation": "rl.envs.base",
    "StepResult": "rl.envs.base",
    "Trajectory": "rl.envs.base",
    "TextGenerationEnv": "rl.envs.base",
    "MultiObjectiveRewardEnv": "rl.envs.objectives",
    "PreferenceComparisonEnv": "rl.envs.objectives",
    "create_math_problem_env": "rl.envs.math",
    "create_code_generation_env": "rl.envs.code",
    "make_env": "rl.envs.registry",
    # every registered trainer's config and trainer class (rl/trainers/registry.py): SFTConfig, SFTTrainer, ...
    **_trainer_exports(),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)

"""The engine, under the module name of the reference docs (`rl.forward_backward`, where
`AsyncTrainingClient` is imported from): a thin public facade over `rl.engine`."""

from rl.engine.client import AsyncTrainingClient
from rl.engine.pipeline import ForwardBackwardPipeline

__all__ = ["AsyncTrainingClient", "ForwardBackwardPipeline"]

"""One reward protocol for every online trainer (PPO, GRPO): reward models, named and custom functions,
environments, and weighted sums of them.

    RewardFn.__call__(prompts: list[str], completions: list[str], columns: dict[str, list])
        -> (values (B,) float32 tensor, NaN where the source gave no score; metrics {name: (B,) tensor})

`columns` holds the prompt rows' other fields, one list of B values per column (TRL's convention,
e.g. `{"answer": [...]}`). Adapters:

    RewardModelReward    a reward model directory written by launch/reward.py: score(prompt + completion)
    FunctionReward       a callable in TRL's signature `f(prompts, completions, **columns)`, the reference's
                         `f(prompts, responses, metadata)` (one dict per row) or `f(prompts, responses)`;
                         rl.rewards.answers names and 'module:function' resolve to one (`resolve_reward_func`)
    EnvironmentReward    an environment's batched `score`; its components are kept as metrics
    WeightedSum          sum_k w_k * r_k over the sources that gave a score (TRL's GRPO semantics:
                         `None` is "no score" and left out; all None -> NaN)

`build_reward_fns(cfg, tokenizer, ...)` builds the WeightedSum of a PPO or GRPO config's sources.

Failures name the source and are `RewardError` (a RunError: launch scripts print one `error:` line and
exit 1): a function that raises, returns NaN/inf (None stays the explicit "no score"), strings, or the
wrong number of values, or runs longer than `reward_timeout` seconds. The timeout runs the call in a
daemon worker thread and waits with a deadline, rather than `signal.alarm`: an alarm works only on the
main thread and on Unix, and would fight the lifecycle's own signal handlers; a thread works wherever the
trainer runs. A thread cannot be killed, so a hung function keeps its thread until the process exits
(daemon: it does not block the exit that follows the error).
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from rl.envs.registry import make_env
from rl.errors import ConfigError, RunError
from rl.models.reward import load_reward_model
from rl.rewards.functions import get_reward_fn, reward_columns_problem

DEFAULT_REWARD_TIMEOUT = 300.0


class RewardError(RunError):
    """A reward source failed or returned something that is not one score per completion."""


class RewardFn(Protocol):
    name: str

    def __call__(self, prompts: list[str], completions: list[str],
                 columns: dict[str, list]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


# ------------------------------------------------------------------------------ checks and calls

def call_with_timeout(fn: Callable[[], Any], timeout: float | None, name: str) -> Any:
    """fn() in a daemon thread, waiting at most `timeout` seconds (None or <= 0: in this thread, no limit).
    An exception from fn is re-raised as RewardError naming the source."""
    if not timeout or timeout <= 0:
        try:
            return fn()
        except RewardError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of user code becomes one named line
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the waiting thread
            box["error"] = e

    worker = threading.Thread(target=run, name=f"reward-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardError(f"reward function {name!r} did not return within reward_timeout={timeout:g} s; "
                          f"make it faster or raise reward_timeout")
    if "error" in box:
        e = box["error"]
        if isinstance(e, RewardError):
            raise e
        raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
    return box.get("value")


def check_values(name: str, values: Any, n: int) -> torch.Tensor:
    """One score per completion -> (n,) float32, NaN for None. Raises RewardError naming the source for
    the wrong count, a value that is not a number (a string, a list), or NaN/inf."""
    if torch.is_tensor(values):
        values = values.detach().float().cpu().reshape(-1).tolist()
    elif hasattr(values, "tolist") and not isinstance(values, (str, bytes)):  # numpy arrays
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RewardError(f"reward function {name!r} returned {type(values).__name__} {_short(values)}; "
                          f"return a list of {n} floats (None for no score)")
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} values for {n} completions "
                          f"({_short(values)}); return one float (or None) per completion")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(float("nan"))
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise RewardError(f"reward function {name!r} returned {type(v).__name__} {v!r} for completion {i}; "
                              f"return floats (None for no score)")
        if not math.isfinite(float(v)):
            raise RewardError(f"reward function {name!r} returned {float(v)} for completion {i}; scores must be "
                              f"finite (return None for 'no score')")
        out.append(float(v))
    return torch.tensor(out, dtype=torch.float32)


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


def columns_to_rows(columns: dict[str, list], n: int) -> list[dict]:
    """TRL's columns {name: [B values]} -> the reference's metadata, one dict per completion."""
    cols = {k: v for k, v in columns.items() if isinstance(v, (list, tuple)) and len(v) == n}
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def rows_to_columns(rows: Sequence[dict] | None, n: int) -> dict[str, list]:
    """The inverse: metadata rows (or None) -> columns; a key missing in a row is None there."""
    if not rows:
        return {}
    keys = list(dict.fromkeys(k for r in rows for k in (r or {})))
    return {k: [(r or {}).get(k) for r in rows] for k in keys}


def reward_columns(rows: Sequence[dict], completion_ids: Sequence[Sequence[int]]) -> dict[str, list]:
    """The columns a reward function receives beside prompts and completions (TRL's GRPO convention): each prompt
    row's other fields, one list per column, and `completion_ids`, the completions' token ids."""
    columns = {c: [r.get(c) for r in rows] for c in rows[0] if c not in ("prompt", "_line")}
    return {**columns, "completion_ids": [list(ids) for ids in completion_ids]}


# ------------------------------------------------------------------------------ adapters

def _calling_convention(fn: Callable) -> str:
    """'trl' (keywords prompts=, completions=, **columns), 'metadata' (prompts, responses, metadata) or
    'pair' (prompts, responses)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "metadata"
    kinds = [p.kind for p in params.values()]
    if "completions" in params:
        return "trl"
    if inspect.Parameter.VAR_KEYWORD in kinds and not {"responses", "metadata"} & set(params):
        return "trl"
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "metadata" in params or inspect.Parameter.VAR_POSITIONAL in kinds or len(positional) >= 3:
        return "metadata"
    return "pair"


class FunctionReward:
    """A Python reward function in any of the three signatures (see `_calling_convention`)."""

    def __init__(self, fn: Callable, name: str | None = None, timeout: float | None = DEFAULT_REWARD_TIMEOUT):
        if not callable(fn):
            raise ConfigError(f"reward function {name or fn!r} is not callable: give fn(prompts, completions, "
                              f"**columns) -> list[float]")
        self.fn, self.timeout = fn, timeout
        self.name = name or getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "reward")
        self.convention = _calling_convention(fn)

    def __call__(self, prompts, completions, columns):
        n = len(completions)
        if self.convention == "trl":
            call = lambda: self.fn(prompts=prompts, completions=completions, **columns)  # noqa: E731
        elif self.convention == "metadata":
            rows = columns_to_rows(columns, n)
            call = lambda: self.fn(prompts, completions, rows)  # noqa: E731
        else:
            call = lambda: self.fn(prompts, completions)  # noqa: E731
        return check_values(self.name, call_with_timeout(call, self.timeout, self.name), n), {}


class RewardModelReward:
    """A reward model (rl.trainers.reward.RewardModel or anything with `score(texts) -> (B,)`) scoring the
    prompt and completion as one text, as it was trained on."""

    def __init__(self, model, name: str = "reward_model", timeout: float | None = DEFAULT_REWARD_TIMEOUT):
        self.model, self.name, self.timeout = model, name, timeout

    def __call__(self, prompts, completions, columns):
        # a chat prompt (system_prompt) is scored as its messages' text, as a plain prompt would be
        texts = [(p if isinstance(p, str) else "\n".join(m["content"] for m in p)) + c
                 for p, c in zip(prompts, completions)]
        return check_values(self.name, call_with_timeout(lambda: self.model.score(texts), self.timeout, self.name),
                            len(completions)), {}


class EnvironmentReward:
    """An environment's batched `score(prompts, completions, metadata)`; per-completion components
    (`reward_<name>`, not `reward_total`) are returned as metrics `{<name>: (B,)}`."""

    def __init__(self, env, name: str = "env", timeout: float | None = DEFAULT_REWARD_TIMEOUT):
        self.env, self.name, self.timeout = env, name, timeout

    def __call__(self, prompts, completions, columns):
        n = len(completions)
        rows = columns_to_rows(columns, n)
        values, comps = call_with_timeout(lambda: self.env.score(prompts, completions, rows), self.timeout, self.name)
        metrics = {k[len("reward_"):]: torch.tensor([float(x) for x in v], dtype=torch.float32)
                   for k, v in (comps or {}).items()
                   if k.startswith("reward_") and k != "reward_total" and len(v) == n}
        return check_values(self.name, values, n), metrics


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """(B, F) rewards (NaN where a function returned None) -> (B,) weighted sum over the functions that
    answered; NaN where none did (TRL's GRPO semantics: sum_k w_k r_k with None terms left out)."""
    w = torch.as_tensor(weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    total = (rewards_per_func * w[None]).nansum(dim=1)
    return total.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


class WeightedSum:
    """sum_k w_k * source_k (`combine_rewards`). Metrics: each source's values under its name, and the
    sources' own metrics (an environment's components) under theirs (a clash keeps the source's name as
    prefix, `<source>/<metric>`)."""

    def __init__(self, sources: Sequence[RewardFn], weights: Sequence[float] | None = None):
        self.sources = list(sources)
        if not self.sources:
            raise ConfigError("no reward source")
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"two reward sources are both named {dup[0]!r}; give each a distinct name")
        weights = [1.0] * len(self.sources) if weights is None else [float(w) for w in weights]
        if len(weights) != len(self.sources):
            raise ConfigError(f"reward_weights has {len(weights)} entries but there are {len(self.sources)} reward "
                              f"sources ({', '.join(names)}); give one weight each")
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.name = names[0] if len(names) == 1 else "+".join(names)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def score_each(self, prompts, completions, columns) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(B, F) values of each source (NaN: no score) and the sources' own metrics."""
        per, metrics = [], {}
        for s in self.sources:
            values, m = s(prompts, completions, columns)
            per.append(values)
            for k, v in m.items():
                metrics[f"{s.name}/{k}" if k in self.names or k in metrics else k] = v
        return torch.stack(per, dim=1), metrics

    def __call__(self, prompts, completions, columns):
        per, metrics = self.score_each(prompts, completions, columns)
        return combine_rewards(per, self.weights), {**{n: per[:, j] for j, n in enumerate(self.names)}, **metrics}

    @property
    def env(self):
        """The environment among the sources (it may also supply the prompts), or None."""
        source = self.find(EnvironmentReward)
        return source.env if source is not None else None

    def find(self, kind: type):
        """The first source of adapter type `kind` (e.g. EnvironmentReward), or None."""
        return next((s for s in self.sources if isinstance(s, kind)), None)


# ------------------------------------------------------------------------------ resolving and building

def resolve_reward_func(spec: str | Callable, timeout: float | None = DEFAULT_REWARD_TIMEOUT,
                        custom: str | None = None, key: str = "reward_funcs") -> FunctionReward:
    """An rl.rewards.answers name (default, length_penalty, correctness, custom with `custom`), 'module:function',
    or a callable -> FunctionReward named after it ('module:function' -> 'function')."""
    if callable(spec):
        return FunctionReward(spec, timeout=timeout)
    try:
        fn = get_reward_fn(spec, custom=custom)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    name = (custom if spec == "custom" else spec).replace(":", ".").split(".")[-1]  # module:f, TRL's module.f
    return FunctionReward(fn, name=name, timeout=timeout)


def load_reward_model_source(path: str, trust_remote_code: bool, timeout: float | None) -> RewardModelReward:
    """The reward model directory `path` (launch/reward.py's output_dir) as a source named reward_model."""
    if not Path(path).exists() and not str(path).startswith("tiny:"):
        raise ConfigError(f"reward_model_path {path} does not exist; train one with launch/reward.py first "
                          f"(its output_dir)")
    return RewardModelReward(load_reward_model(path, trust_remote_code=trust_remote_code), timeout=timeout)


def build_reward_fns(cfg, tokenizer, *, reward_funcs: Sequence[Callable | str] = (), reward_model=None,
                     env=None, missing: str = "no reward source") -> WeightedSum:
    """The WeightedSum of a PPO or GRPO config's reward sources, in this order: the environment (`env`,
    else one built from cfg.env_type / PPO's multi_objective), the reward model (`reward_model`, else
    cfg.reward_model_path), the configured functions (GRPO's `reward_funcs` names, PPO's `reward_fn`),
    then the callables given in Python. Weights: `cfg.reward_weights` as a list (one per source, in that
    order) or a mapping (by source name, default 1.0; a multi_objective environment takes the other keys
    as its component weights). No source at all: ConfigError(missing)."""
    timeout = getattr(cfg, "reward_timeout", DEFAULT_REWARD_TIMEOUT)
    names = list(getattr(cfg, "reward_funcs", None) or [])
    if getattr(cfg, "reward_fn", None):
        names.append(cfg.reward_fn)
    key = "reward_funcs" if hasattr(cfg, "reward_funcs") else "reward_fn"
    functions = [resolve_reward_func(s, timeout, custom=getattr(cfg, "custom_reward", None), key=key) for s in names]
    functions += [resolve_reward_func(f, timeout) for f in reward_funcs]
    sources: list[RewardFn] = []
    if env is None and (getattr(cfg, "env_type", None) or getattr(cfg, "multi_objective", False)):
        env = build_env(cfg, tokenizer, not_components={"env", "reward_model", *(f.name for f in functions)})
    if env is not None:
        data = getattr(cfg, "data", None)
        if data is None or (data.path is None and not getattr(data, "mixture", None)):  # the env's prompts are used
            problem = reward_columns_problem(cfg, set((getattr(env, "metadata", None) or [{}])[0]),
                                             f"env_type={getattr(cfg, 'env_type', None) or 'multi_objective'}",
                                             "the environment's prompts' metadata")
            if problem:
                raise ConfigError(problem)
        sources.append(EnvironmentReward(env, timeout=timeout))
    if reward_model is not None:
        sources.append(RewardModelReward(reward_model, timeout=timeout))
    elif getattr(cfg, "reward_model_path", None):
        sources.append(load_reward_model_source(cfg.reward_model_path, cfg.trust_remote_code, timeout))
    sources += functions
    if not sources:
        raise ConfigError(missing)
    return WeightedSum(sources, source_weights(cfg.reward_weights, [s.name for s in sources], env))


def source_weights(weights, names: list[str], env=None) -> list[float] | None:
    """cfg.reward_weights -> one weight per source. A mapping weights sources by name (default 1.0); its
    other keys must be the environment's components (they were handed to a multi_objective env)."""
    if weights is None or isinstance(weights, (list, tuple)):
        return None if weights is None else list(weights)
    components = set(getattr(env, "reward_weights", None) or {})
    unknown = sorted(set(weights) - set(names) - components)
    if unknown:
        raise ConfigError(f"reward_weights names {', '.join(unknown)}, which is neither a reward source "
                          f"({', '.join(names)}) nor a component of the environment; fix the names")
    return [float(weights.get(n, 1.0)) for n in names]


ENVS_WITH_PROMPTS = ("math", "code", "tool_math")  # environments that draw their own problems


def env_keys_problem(cfg, env_supplies_prompts: bool) -> str | None:
    """A key beside the environment's that would have no effect: training data where the environment supplies
    the prompts (`env_supplies_prompts`: GRPO and online DPO read no data beside an environment; PPO reads it) is
    refused, as one line returned (None when all is read). env_config / eval_env_config without an environment
    get a `warning:` line instead: a recipe's mapping cannot be cleared from the command line (env_type=null is
    how a user switches a recipe's environment off)."""
    env = getattr(cfg, "env_type", None) or ("multi_objective" if getattr(cfg, "multi_objective", False) else None)
    if env is None:
        unread = [key for key in ("env_config", "eval_env_config") if getattr(cfg, key, None)]
        if unread:
            print(f"warning: {' and '.join(unread)} not read: no environment (env_type is null)", file=sys.stderr,
                  flush=True)
        return None
    data = getattr(cfg, "data", None)
    if env_supplies_prompts and data is not None and (data.path or getattr(data, "mixture", None)):
        given = f"data.path={data.path}" if data.path else "data.mixture"
        return (f"{given} would not be read: env_type={env} supplies the prompts (and what its reward needs); "
                f"drop {given.split('=')[0]}, or set env_type=null to train on the data's prompts (scored by "
                f"reward_funcs or reward_model_path)")
    return None


def build_env(cfg, tokenizer, not_components: set[str] = frozenset()):
    """The environment of cfg.env_type (PPO: multi_objective=true alone means env_type multi_objective)
    with cfg.env_config. A multi_objective environment takes the keys of a mapping `reward_weights` that
    are not source names as its component weights; one without prompts of its own scores data.path's."""
    env_type = cfg.env_type or "multi_objective"
    env_cfg = dict(cfg.env_config or {})
    if isinstance(cfg.reward_weights, dict) and env_type == "multi_objective":
        env_cfg.setdefault("reward_weights", {k: v for k, v in cfg.reward_weights.items() if k not in not_components})
    if env_type not in ENVS_WITH_PROMPTS and "prompts" not in env_cfg and "prompts_path" not in env_cfg:
        data_path = getattr(getattr(cfg, "data", None), "path", None)
        if data_path is None:
            raise ConfigError(f"environment {env_type!r} needs prompts: set data.path or env_config.prompts_path")
        env_cfg["prompts_path"] = data_path
    try:
        return make_env(env_type, tokenizer, env_cfg)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"env_type={env_type}: {e}") from None

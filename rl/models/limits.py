"""The one place that knows a model's context: how many positions its config says it can attend over.

A model with a learned position table (GPT-2's `n_positions`) has no row for position 1,024 and crashes
the forward with an IndexError; a rotary model (`max_position_embeddings`) runs past it but was never
trained there. So every length a run can reach is compared with this number once, and every path either
cuts (prompts keep their last tokens, as the trainers cut them) or refuses in one line:

    check_length(cfg.max_length, model, cfg.model_name)      the trainers (rl.trainers.base.Trainer.build,
                                                             the reward model): a sequence's whole budget
    prompt_room(model, max_new_tokens, name, key)            chat / eval: the prompt tokens that fit next to
                                                             the answer (the caller cuts from the left)
"""

from __future__ import annotations

from rl.errors import ConfigError

# config fields that bound the positions, the learned-table name first (GPT-2's config also answers
# max_position_embeddings, as an alias of n_positions, but the message should name its own field)
CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "max_sequence_length", "seq_length")


def context_length(model_or_config) -> tuple[int, str] | None:
    """(positions, the config field that says so) of a model (PEFT- or engine-wrapped too) or a
    transformers config; None when its config names no limit."""
    base = getattr(model_or_config, "module", model_or_config)  # a DDP / DeepSpeed engine wraps the model
    config = getattr(base, "config", base)  # a PEFT model answers its base model's config
    if hasattr(config, "get_text_config"):  # a multimodal config: the language model's limit
        config = config.get_text_config()
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None


def check_length(value: int, model, name: str, key: str = "max_length") -> None:
    """Refuse a length budget `value` (config key `key`) above the context of `model` (`name` in the message)."""
    found = context_length(model)
    if found is not None and value > found[0]:
        raise ConfigError(f"key '{key}': {value} tokens exceed {name}'s context of {found[0]} positions (its "
                          f"config's {found[1]}); set {key}={found[0]} or less")


def prompt_room(model, max_new_tokens: int, name: str, key: str = "--max-completion-length") -> int | None:
    """Prompt tokens that fit in `model`'s context next to `max_new_tokens` new ones (None: no limit known);
    refuses when no prompt token fits."""
    found = context_length(model)
    if found is None:
        return None
    if max_new_tokens >= found[0]:
        raise ConfigError(f"{key} {max_new_tokens} leaves no room for the prompt in {name}'s context of "
                          f"{found[0]} positions (its config's {found[1]}); lower {key} below {found[0]}")
    return found[0] - max_new_tokens

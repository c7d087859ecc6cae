"""Typed recipe configs: a YAML recipe as the base, command-line overrides on top, strict validation.

Every trainer has one dataclass schema whose fields carry a one-line help text (`opt(default,
"help")`). `parse_config(Schema, argv)` reads `--config recipe.yaml`, applies `--key value`,
`--key=value` and `key=value` overrides (dotted keys such as `lora.rank=16` reach nested sections),
converts each value to the field's type and builds the dataclass. Mistakes become one `ConfigError`
line naming the key, the value and what was expected; the launch scripts print it and exit with 2.

Why not plain argparse or HfArgumentParser: neither merges a YAML base with overrides of nested
sections, nor suggests the closest key for a typo, which is most of what goes wrong with recipes.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)





class ConfigError(ValueError):
    """A user-facing configuration mistake; its message is one line that says how to fix it."""


class DataError(ValueError):
    """A problem with the user's data; the message is one line naming file, line and column."""


class RunError(RuntimeError):
    """A failure during training that the user can act on; its message is one line."""

"""The run core: `base.Trainer` holds the lifecycle every trainer shares (see its docstring)."""

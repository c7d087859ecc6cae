"""The config layer: typed recipe configs (one dataclass schema per trainer, built from a YAML recipe
with command-line overrides on top and validated strictly, every mistake one `ConfigError` line), the
sections and fields the trainers share, and the batch arithmetic derived from them. It is the bottom
layer above rl.errors, the only one it may import; every other layer may import it.
"""

"""The loader's error, in a module of its own so every loader module can raise it without
importing another."""


class ModelLoadError(ValueError):
    """A checkpoint that is missing, truncated, foreign or inconsistent; names the path."""

"""User-facing errors. The CLI prints their message on one line and exits with code 2."""


class HybridLLMError(Exception):
    """Base class of errors caused by the user's input or environment, not by a bug."""


class ConfigError(HybridLLMError, ValueError):
    """An invalid configuration or parameter value."""


class ModelLoadError(HybridLLMError):
    """A model file is missing, truncated, or of a kind we cannot load."""


class UnsupportedModelError(ModelLoadError):
    """The file is valid but its architecture or tensor types are not supported."""


class ContextOverflowError(HybridLLMError, ValueError):
    """The prompt does not fit in the model's context window."""

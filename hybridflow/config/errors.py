"""``ConfigError`` under the config package's name (defined in ``hybridflow/errors.py``, which imports nothing)."""
from hybridflow.errors import ConfigError

__all__ = ["ConfigError"]

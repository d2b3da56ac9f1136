"""The one exception every config problem raises: one line naming the key(s) and the fix.

It lives outside ``hybridflow.config`` and imports nothing, so the checks the config's ``validate``
calls (``hybridflow.model_files``, ``hybridflow.model_checks``) raise it without importing the
config package back."""


class ConfigError(ValueError):
    """A configuration that cannot run; raised before any worker (or Ray) starts."""

"""The one exception every config problem raises: one line naming the key(s) and the fix."""


class ConfigError(ValueError):
    """A configuration that cannot run; raised before any worker (or Ray) starts."""

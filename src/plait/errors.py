"""plait's exception types (importable without torch)."""


class ConfigError(ValueError):
    """An invalid configuration, raised before any collective runs.

    The message names the offending parameter and says what would be valid.
    """


class CommError(RuntimeError):
    """A point-to-point or collective operation failed: a peer died, closed its connection, or hung."""


class CommTimeoutError(CommError):
    """A rank waited longer than its timeout on a collective or point-to-point operation."""

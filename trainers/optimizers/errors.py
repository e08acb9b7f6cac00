"""Errors raised by the optimizer registry."""
from bv_sharding import ShardingError


class OptimizerError(ShardingError):
    """Bad optimizer name or arguments; the message says what would work.

    Example:
        >>> issubclass(OptimizerError, ShardingError)
        True
    """

"""Errors raised by the optimizer registry."""


class OptimizerError(ValueError):
    """Bad optimizer name or arguments; the message says what would work.

    Example:
        >>> issubclass(OptimizerError, ValueError)
        True
    """

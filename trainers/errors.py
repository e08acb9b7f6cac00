"""Errors of the trainer: config mistakes, by kind, under the project's one root.

``ConfigError`` covers anything wrong in a training config (an unknown model,
task, optimizer, config key or argument, a value out of range);
``OptimizerError`` narrows it to the optimizer's name and arguments;
``NonFiniteLossError`` stops a run whose loss diverged. All are
``bv_sharding.Error``, so ``except bvs.Error`` catches every mistake of ours.

Example:
  >>> import bv_sharding as bvs
  >>> issubclass(OptimizerError, ConfigError) and issubclass(ConfigError, bvs.Error)
  True
"""

from bv_sharding import Error


class ConfigError(Error):
  """A training config value the trainer cannot use; the message names ``config.<key>`` and a fix."""


class OptimizerError(ConfigError):
  """An unknown optimizer or arguments its constructor does not take."""


class NonFiniteLossError(Error):
  """Training produced a NaN or infinite loss; the message gives the step and the last finite loss."""

"""What differs between training tasks: data splits, batches, model inputs and the loss.

``config.input`` picks the task: "text" (next-byte prediction with a language model)
or "digits" (8x8 digit classification with a ViT). Everything else in the trainer
is the same for both.

Example:
  >>> import jax
  >>> from configs import lm
  >>> from trainers import models
  >>> config = lm.get_config()  # config.input == "text"
  >>> task = get_task(config)
  >>> batch = next(task.batches(task.train, global_batch=2, seed=0))
  >>> model = models.get_model(config.model_name, **config.model)
  >>> params = model.init(jax.random.key(0), task.inputs(batch))["params"]
  >>> logits = model.apply({"params": params}, task.inputs(batch))
  >>> batch.shape, logits.shape, task.unit  # bytes in, a logit per byte value out
  ((2, 129), (2, 128, 256), 'tokens')
  >>> bool(task.loss(logits, batch) > 0)
  True
"""

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import optax

from trainers import data
from trainers.errors import ConfigError


class Task(NamedTuple):
  """A task's data and loss; ``unit``/``per_example`` name and count what one example holds."""

  train: Any
  held_out: Any
  batches: Callable[..., Iterator[Any]]  # (split, global_batch=, seed=, start_step=) -> local
  inputs: Callable[[Any], Any]  # batch -> model input
  loss: Callable[[Any, Any], Any]  # (logits, batch) -> mean loss
  unit: str
  per_example: int


def cross_entropy(logits, labels):
  """Mean softmax cross-entropy against integer labels.

  Example:
    >>> import jax.numpy as jnp
    >>> round(float(cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3]))), 4)  # log(4)
    1.3863
  """
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def text(config) -> Task:
  """Next-byte prediction on windows of ``config.seq_len + 1`` bytes: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
  train, held_out = data.load_text()
  return Task(
      train,
      held_out,
      batches=lambda split, **kw: data.text_batches(split, seq_len=config.seq_len, **kw),
      inputs=lambda batch: batch[:, :-1],
      loss=lambda logits, batch: cross_entropy(logits, batch[:, 1:]),
      unit="tokens",
      per_example=config.seq_len,
  )


def digits(config) -> Task:
  """Classification of sklearn's 8x8 digits: inputs ``batch["image"]``, targets ``batch["label"]``."""
  del config  # Unused: the digits have one fixed size.
  train, held_out = data.load_digits()
  return Task(
      train,
      held_out,
      batches=data.image_batches,
      inputs=lambda batch: batch["image"],
      loss=lambda logits, batch: cross_entropy(logits, batch["label"]),
      unit="images",
      per_example=1,
  )


TASKS = {"text": text, "digits": digits}


def get_task(config) -> Task:
  """The task named by ``config.input`` (see the module example); unknown names raise ``ConfigError``."""
  if config.input not in TASKS:
    raise ConfigError(
        f"config.input={config.input!r} is not a task; choose from " f"{sorted(TASKS)}"
    )
  return TASKS[config.input](config)

"""What differs between training tasks: data splits, batches, model inputs and the loss.

`config.input` picks the task: "text" (next-byte prediction with a language model)
or "digits" (8x8 digit classification with a ViT). Everything else in the trainer
is the same for both.

Example:
  >>> task = get_task(config)                       # config.input == "text"
  >>> local = next(task.batches(task.train, global_batch=32, seed=0))
  >>> logits = model.apply({"params": params}, task.inputs(batch))
  >>> loss = task.loss(logits, batch)
"""

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import optax

from trainers import data
from trainers.errors import ConfigError


class Task(NamedTuple):
  """A task's data and loss; `unit`/`per_example` name and count what one example holds."""

  train: Any
  held_out: Any
  batches: Callable[..., Iterator[Any]]  # (split, global_batch=, seed=, start_step=) -> local
  inputs: Callable[[Any], Any]  # batch -> model input
  loss: Callable[[Any, Any], Any]  # (logits, batch) -> mean loss
  unit: str
  per_example: int


def cross_entropy(logits, labels):
  """Mean softmax cross-entropy against integer labels.

  Example: `cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3]))` == log(4).
  """
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def text(config) -> Task:
  """Next-byte prediction on windows of `config.seq_len + 1` bytes.

  Example: `text(config).inputs(windows)` is `windows[:, :-1]`.
  """
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
  """Classification of sklearn's 8x8 digits.

  Example: `digits(config).inputs(batch)` is `batch["image"]`.
  """
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
  """The task named by `config.input`.

  Example: `get_task(config).unit == "tokens"` for `config.input = "text"`.
  """
  if config.input not in TASKS:
    raise ConfigError(
        f"config.input={config.input!r} is not a task; choose from " f"{sorted(TASKS)}"
    )
  return TASKS[config.input](config)

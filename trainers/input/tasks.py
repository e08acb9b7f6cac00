"""What differs between training tasks: data splits, batches, model inputs and the loss.

``config.input`` (trainers/input/sources.py) picks the task: "tokens" and "text" are
next-token prediction with a language model, "images" and "digits" image
classification with a ViT. Everything else in the trainer is the same for all.
``Task.check(model)`` compares the data with the model (token ids below its
vocab_size, labels below its num_classes) before anything is initialised.

Example:
  >>> import jax
  >>> from configs import lm
  >>> from trainers import models
  >>> config = lm.get_config()  # config.input: the standard library's source as text
  >>> config.seq_len = 16
  >>> task = get_task(config)
  >>> model = models.get_model(config.model_name, **config.model.to_dict())
  >>> task.check(model)
  >>> batch = next(task.batches(task.train, global_batch=2, seed=0))
  >>> params = jax.jit(model.init)(jax.random.key(0), task.inputs(batch))["params"]
  >>> logits = model.apply({"params": params}, task.inputs(batch))
  >>> batch.shape, logits.shape, task.unit  # bytes in, a logit per byte value out
  ((2, 17), (2, 16, 256), 'tokens')
  >>> bool(task.loss(logits, batch) > 0)
  True
"""

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from trainers.errors import ConfigError
from trainers.input import batching, records, sources


class Task(NamedTuple):
  """A task's data and loss; ``unit``/``per_example`` name and count what one example holds."""

  train: Any
  held_out: Any
  batches: Callable[..., Iterator[Any]]  # (split, global_batch=, seed=, start_step=) -> local
  inputs: Callable[[Any], Any]  # batch -> model input
  loss: Callable[[Any, Any], Any]  # (logits, batch) -> mean loss
  unit: str
  per_example: int
  check: Callable[..., None]  # (model, largest=) -> None; ConfigError if the data does not fit
  prefetch: int  # batches prepared ahead of the step
  bytes_per_token: float | None = None  # of held_out's text, for bits per byte (None: unknown)


def cross_entropy(logits, labels):
  """Mean softmax cross-entropy against integer labels.

  Example:
    >>> import jax.numpy as jnp
    >>> round(float(cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3]))), 4)  # log(4)
    1.3863
  """
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def language_model(config, spec) -> Task:
  """Next-token prediction on windows of ``config.seq_len + 1`` tokens of token files or text.

  Example: ``language_model(config, spec).inputs(windows)`` is ``windows[:, :-1]``.
  """
  train, held_out = sources.open_tokens(spec)
  sources.check_length(train, config.seq_len, "config.input.train", "more data")
  if spec.tune_fraction:
    tune = f"the tuning slice (config.input.tune_fraction={spec.tune_fraction}) of train"
    sources.check_length(held_out, config.seq_len, tune, "raise it, or use more data")
  elif spec.val:
    sources.check_length(held_out, config.seq_len, "config.input.val", "a longer file")
  else:
    tail = f"the held-out tail (config.input.eval_fraction={spec.eval_fraction}) of train"
    sources.check_length(held_out, config.seq_len, tail, "raise it, or set config.input.val")

  def check(model, largest=sources.max_token):
    for stream in (train, held_out) if spec.val else (train,):  # Else held_out is train's tail.
      sources.check_token_ids(stream, model.config.vocab_size, spec.vocab_size, largest)

  return Task(
      train,
      held_out,
      batches=lambda split, **kw: batching.text_batches(split, seq_len=config.seq_len, **kw),
      inputs=lambda batch: batch[:, :-1],
      loss=lambda logits, batch: cross_entropy(logits, batch[:, 1:]),
      unit="tokens",
      per_example=config.seq_len,
      check=check,
      prefetch=spec.prefetch,
      bytes_per_token=records.bytes_per_token(held_out, spec.kind),
  )


def image_pixels(images):
  """Model input: uint8 images scaled to [0, 1] float32; float images as they are.

  Example: ``image_pixels(jnp.full((1, 2, 2, 1), 255, jnp.uint8)).max() == 1.0``.
  """
  return images.astype(jnp.float32) / 255 if images.dtype == jnp.uint8 else images


def classifier(config, spec) -> Task:
  """Image classification of .npy images or sklearn's 8x8 digits.

  Example: ``classifier(config, spec).inputs(batch)`` is ``batch["image"]`` in [0, 1].
  """
  del config  # Unused: the images carry their size.
  if spec.kind == "digits":
    train, held_out = sources.load_digits()
  elif spec.val:
    train, held_out = (sources.open_image_split(spec, key) for key in ("train", "val"))
  else:
    train, held_out = sources.holdout_split(
        sources.open_image_split(spec, "train"), spec.eval_fraction
    )
    if not len(held_out["label"]):
      raise ConfigError(
          f"config.input.val is empty and eval_fraction={spec.eval_fraction} of {spec.train} "
          "leaves no held-out images; set config.input.val or eval_fraction"
      )

  def check(model, largest=None):
    del largest  # Labels are few: always scanned.
    for key, split in (("train", train), ("val" if spec.val else "train", held_out)):
      sources.check_labels(split, model.num_classes, key)

  return Task(
      train,
      held_out,
      batches=batching.image_batches,
      inputs=lambda batch: image_pixels(batch["image"]),
      loss=lambda logits, batch: cross_entropy(logits, batch["label"]),
      unit="images",
      per_example=1,
      check=check,
      prefetch=spec.prefetch,
  )


TASKS = {
    "tokens": language_model,
    "text": language_model,
    "images": classifier,
    "digits": classifier,
}


def get_task(config) -> Task:
  """The task of ``config.input``'s kind, its files opened and checked (nothing read whole).

  Example: ``get_task(config).unit == "tokens"`` for ``config.input = "text"``.
  """
  spec = sources.input_spec(config.input)
  return TASKS[spec.kind](config, spec)

"""Workdirs are local paths or ``gs://`` URLs: one path abstraction, orbax's (``etils.epath``).

Everything a run writes goes through :func:`path` (an ``epath.Path``: the local filesystem, or
gcsfs for ``gs://``); orbax writes the checkpoints' arrays through TensorStore's GCS driver.
Object stores have no append and no rename, so the two operations that need them are here:
:func:`write_whole` (local: a temporary file renamed into place; a bucket: one object write,
which readers see whole or not at all) and :func:`move` (local: a rename; a bucket on either
side: each file or object copied, then deleted).

:func:`check` validates a URL before anything starts, by what this machine has, without any
network call: the backend package is importable (the ``.[gcs]`` extra) and credentials are
configured (a credentials file, an emulator, or a Google Compute Engine VM, whose metadata
server provides them, detected by its BIOS name file as google-auth does). Any other scheme is
a ``ConfigError``: a URL never becomes a local folder named after it.

Example:
  >>> is_url("gs://bucket/run"), is_url("/tmp/run"), is_url("runs/lm")
  (True, False, False)
  >>> check("memory://run")
  Traceback (most recent call last):
  ...
  bv_sharding.errors.ConfigError: --workdir=memory://run: the scheme memory:// is not supported; use a local path or a gs:// URL
"""

import importlib.util
import os
import re

from etils import epath

from trainers.errors import ConfigError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
SCHEMES = ("gs",)
_MANGLED = re.compile(rf"^({'|'.join(SCHEMES)}):/?(?!/)(.*)$")
# What a gs:// workdir needs: epath reaches GCS through fsspec's gcsfs; TensorBoard's files and
# the trainer's go through epath too.
GCS_PACKAGES = ("gcsfs",)
# With STORAGE_EMULATOR_HOST (gcsfs's endpoint): TensorStore's endpoint and token, gcsfs's token.
EMULATOR = ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING", "FSSPEC_GCS_TOKEN")
GCE_PRODUCT_NAME = "/sys/class/dmi/id/product_name"  # "Google..." on a GCE or TPU VM.
ADC = "application_default_credentials.json"  # gcloud auth application-default login


def is_url(path) -> bool:
  """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
  return bool(_URL.match(os.fspath(path)))


def mangled_url(location) -> str | None:
  """The URL ``location`` was likely meant as, where it starts with a supported scheme and a
  colon but not ``://`` (``gs:/bucket/run``, ``gs:bucket/run``); else None.

  Example:
    >>> mangled_url("gs:/bucket/run"), mangled_url("gs:bucket"), mangled_url("runs/gs:1")
    ('gs://bucket/run', 'gs://bucket', None)
  """
  match = _MANGLED.match(os.fspath(location))
  return None if match is None else f"{match.group(1)}://{match.group(2)}"


def path(location) -> epath.Path:
  """``location`` (a local path or a checked URL) as an ``epath.Path``."""
  return epath.Path(location)


def check(url: str) -> None:
  """Raises ``ConfigError`` unless this machine can reach workdir ``url``; no network call.

  Example: ``check("gs://bucket/run")`` raises naming ``pip install -e ".[gcs]"`` without gcsfs.
  """
  scheme = _URL.match(url).group(1)
  if scheme not in SCHEMES:
    raise ConfigError(
        f"--workdir={url}: the scheme {scheme}:// is not supported; use a local path or a gs:// URL"
    )
  missing = [name for name in GCS_PACKAGES if importlib.util.find_spec(name) is None]
  if missing:
    raise ConfigError(
        f"--workdir={url}: a gs:// workdir needs {', '.join(missing)}, which is not installed; "
        'pip install -e ".[gcs]" (gcsfs, google-cloud-storage)'
    )
  unset = [name for name in EMULATOR if not os.environ.get(name)]
  if os.environ.get("STORAGE_EMULATOR_HOST") and unset:
    raise ConfigError(
        f"--workdir={url}: STORAGE_EMULATOR_HOST points gcsfs at an emulator, but {unset[0]} is "
        f"not set, so some requests would leave this machine; set {', '.join(unset)} "
        "(docs/durability.md: a bucket on an emulator)"
    )
  if credentials() is None:
    raise ConfigError(
        f"--workdir={url}: no Google Cloud credentials configured here; set "
        "GOOGLE_APPLICATION_CREDENTIALS to a key file or run `gcloud auth application-default "
        "login` (on a GCE/TPU VM the metadata server provides them)"
    )


def credentials() -> str | None:
  """Where this machine's GCS credentials come from, from env vars and files only; None: none.

  Example: ``credentials()`` == "GOOGLE_APPLICATION_CREDENTIALS" with a key file set.
  """
  key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
  if key and os.path.isfile(key):
    return "GOOGLE_APPLICATION_CREDENTIALS"
  if os.environ.get("STORAGE_EMULATOR_HOST"):
    return "STORAGE_EMULATOR_HOST"
  gcloud = os.environ.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud")
  if os.path.isfile(os.path.join(gcloud, ADC)):
    return os.path.join(gcloud, ADC)
  try:
    with open(GCE_PRODUCT_NAME) as f:
      on_gce = f.read().strip().startswith("Google")
  except OSError:
    on_gce = False
  return "the GCE metadata server" if on_gce else None


def write_whole(target: epath.Path, text: str) -> None:
  """Writes ``target`` whole, so a reader sees the old or the new content, never a part.

  Local: a temporary file beside it, renamed into place; a bucket: one object write.
  """
  if is_url(target):
    target.write_text(text)
    return
  tmp = target.parent / f".{target.name}.tmp"
  tmp.write_text(text)
  os.replace(tmp, target)


def move(source: epath.Path, target: epath.Path) -> None:
  """Moves file or directory ``source`` to ``target`` (a bucket on either side: copies each
  file or object, then deletes it, nothing before its copy is written; a local directory
  emptied so is removed too)."""
  if not is_url(source) and not is_url(target):
    os.replace(source, target)
    return
  if source.is_dir():
    for child in source.iterdir():
      move(child, target / child.name)
    if not is_url(source):
      source.rmdir()
    return
  target.write_bytes(source.read_bytes())
  source.unlink()

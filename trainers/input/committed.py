"""A directory of files that change together: a run stages them, one rename commits them all.

The converter's outputs (``train.bin``, ``val.bin``, their records, a trained tokenizer) must
never mix two runs. A run writes them into its own staging directory inside the output
directory, ``.convert-<pid>-<random>/``, and :meth:`Output.commit` makes it current by one
``os.replace`` of the symlink ``.current``. Each file is read through its usual name, a
symlink ``NAME -> .current/NAME``, so a reader opening ``train.bin`` gets the file of the
last committed run; a kill at any moment leaves the last commit's files, or the new ones,
whole. Files an earlier converter left in place (plain files, not symlinks) are first
hard-linked into a directory made current, so replacing each by its symlink changes no
content.

A run holds an ``flock`` on its staging directory until it commits or ends, and the kernel
drops it when the process dies (SIGKILL too). So a new :class:`Output` removes what killed or
superseded runs left (unlocked directories that are not current, the earlier converter's
``NAME.partial-<pid>`` files whose process is gone) and leaves a running converter's
directory alone; its ``note`` says which.

Example:
  >>> import os, tempfile
  >>> out = tempfile.mkdtemp()
  >>> output = Output(out)
  >>> with open(output.path("train.bin"), "w") as f:
  ...   _ = f.write("new")
  >>> output.commit()
  >>> output.close()
  >>> open(os.path.join(out, "train.bin")).read(), os.readlink(os.path.join(out, "train.bin"))
  ('new', '.current/train.bin')
  >>> staged = os.readlink(os.path.join(out, ".current"))
  >>> sorted(os.listdir(out)) == sorted([".current", staged, "train.bin"])
  True
"""

import fcntl
import os
import re
import shutil
import tempfile

CURRENT = ".current"  # A symlink to the committed run's directory.
_PREFIX = ".convert-"  # A run's directory: .convert-<pid>-<random>.
_PARTIAL = re.compile(r"\.partial-(\d+)$")  # The earlier converter's temporary files.


class Output:
  """A staging directory in existing directory ``out_dir``, locked by this process until
  :meth:`close`; ``note``: what earlier runs left that was removed or kept (or None)."""

  def __init__(self, out_dir: str):
    self.out_dir, self.committed = out_dir, False
    self.note = _clean(out_dir)
    self.staged = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=out_dir)
    self.lock = os.open(self.staged, os.O_RDONLY)
    fcntl.flock(self.lock, fcntl.LOCK_EX)

  def path(self, name: str) -> str:
    """Where this run writes file ``name``."""
    return os.path.join(self.staged, name)

  def commit(self) -> None:
    """Makes the staged files ``out_dir``'s by one rename; then removes the earlier run's
    directory, and the names only it had."""
    names = os.listdir(self.staged)
    _adopt_plain_files(self.out_dir, names)
    for name in names:  # A name new to out_dir dangles (is absent) until the commit.
      _link(os.path.join(CURRENT, name), os.path.join(self.out_dir, name))
    earlier = _current(self.out_dir)
    _link(os.path.basename(self.staged), os.path.join(self.out_dir, CURRENT))  # The commit.
    self.committed = True
    for name in os.listdir(self.out_dir):
      path = os.path.join(self.out_dir, name)
      if _through_current(path) and not os.path.exists(path):
        os.remove(path)
    if earlier:
      shutil.rmtree(os.path.join(self.out_dir, earlier))

  def close(self) -> None:
    """Unlocks the staging directory; removes it unless committed."""
    os.close(self.lock)
    if not self.committed:
      shutil.rmtree(self.staged)


def _clean(out_dir: str) -> str | None:
  """Removes what earlier runs left in ``out_dir`` but the current files; a note or None."""
  removed, running = [], []
  current = _current(out_dir)
  for name in sorted(os.listdir(out_dir)):
    path = os.path.join(out_dir, name)
    if name.startswith(_PREFIX) and name != current and os.path.isdir(path):
      if _locked(path):
        running.append(name)
      else:
        shutil.rmtree(path)
        removed.append(name)
    elif (partial := _PARTIAL.search(name)) and not _alive(int(partial.group(1))):
      os.remove(path)
      removed.append(name)
  notes = []
  if removed:
    notes.append(f"removed what interrupted runs left in {out_dir}: {', '.join(removed)}")
  if running:
    notes.append(f"left {', '.join(running)} in {out_dir}: a converter is writing it")
  return "; ".join(notes) or None


def _adopt_plain_files(out_dir: str, names) -> None:
  """Makes plain files among ``names`` (an earlier converter's) symlinks through ``.current``,
  their content unchanged: every file of ``names`` is hard-linked into a new directory made
  current first."""
  paths = [os.path.join(out_dir, n) for n in names]
  plain = [p for p in paths if os.path.isfile(p) and not os.path.islink(p)]
  if not plain:
    return
  adopted = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=out_dir)
  for path in paths:
    if os.path.isfile(path):  # Through a symlink: the current file.
      os.link(os.path.realpath(path), os.path.join(adopted, os.path.basename(path)))
  earlier = _current(out_dir)
  _link(os.path.basename(adopted), os.path.join(out_dir, CURRENT))
  for path in plain:
    _link(os.path.join(CURRENT, os.path.basename(path)), path)
  if earlier:
    shutil.rmtree(os.path.join(out_dir, earlier))


def _link(target: str, path: str) -> None:
  """Points symlink ``path`` at ``target``, replacing what is there in one rename."""
  if os.path.islink(path) and os.readlink(path) == target:
    return
  tmp = f"{path}.partial-{os.getpid()}"
  os.symlink(target, tmp)
  os.replace(tmp, path)


def _current(out_dir: str) -> str | None:
  """The name of ``out_dir``'s committed directory, or None."""
  link = os.path.join(out_dir, CURRENT)
  return os.readlink(link) if os.path.islink(link) else None


def _through_current(path: str) -> bool:
  return os.path.islink(path) and os.readlink(path).startswith(CURRENT + os.sep)


def _locked(directory: str) -> bool:
  """Whether a process holds the lock of staging ``directory``."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    return True
  finally:
    os.close(fd)
  return False


def _alive(pid: int) -> bool:
  """Whether process ``pid`` exists."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True

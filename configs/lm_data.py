"""configs/lm.py on your own data: token files (nanoGPT's train.bin/val.bin) or a text corpus.

  python -m trainers.convert ~/my_text /data/my_text --train_tokenizer --vocab_size=8192
  python -m trainers.train --workdir runs/own \
      --config configs/lm_data.py:train=/data/my_text/train.bin,val=/data/my_text/val.bin
  python -m trainers.train --workdir runs/owt \
      --config configs/lm_data.py:train=/data/owt/train.bin,val=/data/owt/val.bin,vocab=50304,size=125m
  python -m trainers.train --workdir runs/txt \
      --config configs/lm_data.py:kind=text,train=~/my_text   # UTF-8 files read directly as bytes

Without ``dtype=``/``vocab=`` both come from the record ``trainers.convert`` wrote beside the
files (the vocab rounded up to a multiple of 128: trainers/input/records.py); token files
without one (nanoGPT's) are uint16 and need ``vocab=``. Every key of config.input (trainers/input/sources.py) can also be overridden, e.g.
``--config.input.train='/data/shards/*.bin' --config.input.eval_fraction=0.01``.
"""

from configs import lm
from configs.common import parse_arg
from trainers.input import sources


def get_config(arg=None):
  """arg: ``kind=tokens|text,train=PATH,val=PATH,dtype=uint16,vocab=50304,size=tiny``.

  ``dtype=""`` and ``vocab=0`` (the defaults): the record's.
  """
  arg = parse_arg(arg, kind="tokens", train="", val="", dtype="", vocab=0, size="tiny")
  config = lm.get_config(f"size={arg['size']}")
  config.input = sources.input_config(
      kind=arg["kind"], train=arg["train"], val=arg["val"], dtype=arg["dtype"]
  )
  config.model.vocab_size = arg["vocab"]
  return config

"""configs/lm.py on your own data: token files (nanoGPT's train.bin/val.bin) or a text corpus.

  python -m trainers.convert ~/my_text /data/my_text       # once: train.bin, val.bin (bytes)
  python -m trainers.train --workdir runs/own \
      --config configs/lm_data.py:train=/data/my_text/train.bin,val=/data/my_text/val.bin,dtype=uint8
  python -m trainers.train --workdir runs/owt \
      --config configs/lm_data.py:train=/data/owt/train.bin,val=/data/owt/val.bin,vocab=50304,size=125m
  python -m trainers.train --workdir runs/txt \
      --config configs/lm_data.py:kind=text,train=~/my_text   # UTF-8 files read directly as bytes

Every key of config.input (trainers/input/sources.py) can also be overridden, e.g.
``--config.input.train='/data/shards/*.bin' --config.input.eval_fraction=0.01``.
"""

from configs import lm
from configs.common import parse_arg
from trainers.input import sources


def get_config(arg=None):
  """arg: ``kind=tokens|text,train=PATH,val=PATH,dtype=uint16,vocab=256,size=tiny``."""
  arg = parse_arg(arg, kind="tokens", train="", val="", dtype="uint16", vocab=256, size="tiny")
  config = lm.get_config(f"size={arg['size']}")
  config.input = sources.input_config(
      kind=arg["kind"], train=arg["train"], val=arg["val"], dtype=arg["dtype"]
  )
  config.model.vocab_size = arg["vocab"]
  return config

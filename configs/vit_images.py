"""configs/vit_digits.py on your own images: directories of images.npy (uint8 N,H,W,C) + labels.npy.

  python -m trainers.train --workdir runs/vit-own \
      --config configs/vit_images.py:train=/data/imgs/train,val=/data/imgs/val,classes=10,patch=4

The arrays are memory-mapped, so they may be larger than memory (save them with
np.save, not np.savez: .npz cannot be memory-mapped). ``val=`` empty holds out the
last config.input.eval_fraction of train.
"""

from configs import vit_digits
from configs.common import parse_arg
from trainers.input import sources


def get_config(arg=None):
  """arg: ``train=DIR,val=DIR,classes=10,patch=2,size=tiny``."""
  arg = parse_arg(arg, train="", val="", classes=10, patch=2, size="tiny")
  config = vit_digits.get_config(f"size={arg['size']}")
  config.input = sources.input_config(kind="images", train=arg["train"], val=arg["val"])
  config.model = dict(size=arg["size"], num_classes=arg["classes"], patch_size=arg["patch"])
  return config

"""Train ResMLP or ResNet on ImageNet (ILSVRC 2012) at 224px with compressed activation residuals.

Example: python -m train.imagenet --model s12 --sparsity 0.7 --block 16 --data-dir ~/imagenet
ResNet-50 (7x7 stem, BatchNorm), every conv input pooled 2x2 for its weight gradient:
python -m train.imagenet --model resnet50 --compression pool2 --data-dir ~/imagenet
(--data-dir holds ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar, tfds' manual_dir layout,
or an image folder train/<class>/*.JPEG, val/<class>/*.JPEG).
Over several processes (hosts): run it in each with --coordinator HOST:PORT --num-processes N
--process-id I added (docs/sharding.md, "Training on several processes").
"""

import sys

from train.cli import main
from train.config import IMAGENET_DEFAULTS

if __name__ == "__main__":
    sys.exit(main("train.imagenet", __doc__, IMAGENET_DEFAULTS, ("imagenet2012", "imagefolder"), sys.argv[1:]))

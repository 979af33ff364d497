"""Train ResMLP or ResNet on CIFAR-10/100 with compressed activation residuals.

Example: python -m train.cifar --sparsity 0.7 --block 16 --data-dir cifar-10-python.tar.gz
ResNet-18 (3x3 stem, BatchNorm), every conv input pooled 2x2 for its weight gradient:
python -m train.cifar --model resnet18 --compression pool2 (or pool4, or --sparsity 0.7)
Without --data-dir, CIFAR is looked for in tfds' manual dir and ~/.cache/bsr_jax/downloads, else
downloaded there. The tiny preset takes about 3 minutes per epoch on 2 CPU cores (the default 100
epochs: about 5 hours); --epochs 3 or --steps 100 for a quick run.
Over several processes (hosts): run it in each with --coordinator HOST:PORT --num-processes N
--process-id I added (docs/sharding.md, "Training on several processes").
"""

import sys

from train.cli import main
from train.config import CIFAR_DEFAULTS

if __name__ == "__main__":
    sys.exit(main("train.cifar", __doc__, CIFAR_DEFAULTS, ("cifar10", "cifar100", "imagefolder"), sys.argv[1:]))

"""Train ResMLP on CIFAR-10/100 with block-sparse activation residuals.

Example: python -m train.cifar --sparsity 0.7 --block 16 --data-dir ../shared/data/cifar10-jpg.tar.gz
(tiny preset: 2-3 minutes per epoch on 2 CPU cores; 1 epoch reaches ~40% test accuracy).
"""

import sys

from train.cli import main
from train.config import CIFAR_DEFAULTS

if __name__ == "__main__":
    sys.exit(main("train.cifar", __doc__, CIFAR_DEFAULTS, ("cifar10", "cifar100", "imagefolder"), sys.argv[1:]))

"""``Compression``: what a layer's backward may keep of its input instead of the input itself."""

from bsr_jax.storage.pruning import Pruning
from bsr_jax.storage.pooling import Pooling

Compression = Pruning | Pooling

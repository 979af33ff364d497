"""Storage formats: how a residual is kept for the backward pass.

Owns: ``Pruning`` and the static-capacity block-sparse ``BlockSparse`` (``format``), block selection
(``selection``), int8/int4 codes with per-block scales (``quantize``), pooled convolution inputs
(``pooling``), ``Compression`` (either of them), and the barriers that keep XLA from fusing a
stored residual back into its source (``barriers``).
May import: ``core``.
"""

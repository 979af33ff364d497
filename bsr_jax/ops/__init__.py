"""The differentiable operations and layers: ``bsr_linear`` (``linear``), compressed convolutions
(``conv``), scale/shift (``elementwise``), compressed storage for exact-dx inputs (``dx``), chunked
losses (``losses``, ``head_loss``), dot-product attention with flash attention's backward over
materialised probabilities (``attention``) and the Flax layers ``Dense``, ``Affine``, ``LayerScale``
(``layers``). Each is a ``custom_vjp`` whose forward and input gradient are exact.
A layer asks ``core.layer_choice`` what to keep; it never imports the rewriting that answers.
May import: ``core``, ``storage``, ``backends``.
"""

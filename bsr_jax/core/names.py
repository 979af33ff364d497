"""The ``jax.ad_checkpoint.checkpoint_name``s bsr_jax gives what a backward keeps: ``jax.checkpoint``
policies (``save_only_these_names``) and the compiled-memory reports find them by these names."""

RESIDUAL_NAME = "bsr_blocks"  # a compressed weight-gradient residual (``bsr_jax.BlockSparse``'s arrays)
LEAN_NAME = "bsr_jax_lean"  # a small value worth keeping (ReLU's packed mask, the loss's logsumexp)

"""What a training step needs: compiled peaks and modelled times (deviceless H100 and TPU v5p),
residual bytes, sharded steps, the memory-time plane and its check on a real GPU."""

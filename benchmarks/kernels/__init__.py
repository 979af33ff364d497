"""The weight-gradient kernels alone, against dense ``x.T @ dy``."""

"""What compression costs in accuracy and in gradient error: CIFAR grids, the Pareto front, the
ResNet and LM studies, per-layer gradient errors."""

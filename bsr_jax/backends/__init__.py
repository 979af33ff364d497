"""Weight-gradient kernels over stored blocks: the C++ XLA custom call on CPU, Pallas (Triton) on
GPU, plain XLA elsewhere, and the one table that picks between them (``dispatch``).
May import: ``core``, ``storage``, and the kernel packages ``cpu_kernels`` and ``pallas_kernels``.
"""

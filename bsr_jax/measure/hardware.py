"""The accelerators the roofline (``bsr_jax.measure.roofline``) models: their peak rates."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Peak rates of one accelerator.

    ``matmul_flops`` maps an operand dtype (HLO's names: ``f32``, ``bf16``, ``s8`` ...) to dense
    matrix-unit FLOP/s; ``default_flops`` is used for dtypes not listed."""

    name: str
    hbm_bytes_per_s: float
    matmul_flops: Mapping[str, float]
    default_flops: float
    launch_s: float
    host_bytes_per_s: float
    link_bytes_per_s: float = 0.0  # device-to-device interconnect, one direction (0: no collectives modelled)
    # Streaming multiprocessors: how many programs of a Triton kernel run at once (ours, one each: their
    # pipelined tiles take most of an SM's shared memory). 0: no GPU, waves not modelled.
    sms: int = 0


# H100 SXM: 3.35 TB/s HBM3; dense tensor cores 495 TFLOP/s TF32 (JAX's default f32 matmul on
# H100), 989 bf16/f16, 1979 fp8/int8; PCIe gen5 x16 to the host ~55 GB/s; ~2 us per launch;
# NVLink 4 between the 8 GPUs of a host: 900 GB/s both ways, 450 GB/s each way; 132 SMs.
H100 = Hardware(
    "h100", 3.35e12, {"f32": 495e12, "bf16": 989e12, "f16": 989e12, "f8e4m3fn": 1979e12, "f8e5m2": 1979e12, "s8": 1979e12},
    495e12, 2e-6, 55e9, 450e9, sms=132,
)
# TPU v5p (one chip): 2.765 TB/s HBM2e; 459 TFLOP/s bf16 on the MXUs (f32 matmuls at default
# precision run as bf16 passes there), 918 int8; no kernel launches; ICI 4,800 Gbps per chip as
# Google lists it (600 GB/s, all links together: a ring uses a share of it, so this is optimistic).
TPU_V5P = Hardware("tpu-v5p", 2.765e12, {"s8": 918e12}, 459e12, 0.0, 50e9, 600e9)
HARDWARE = {"h100": H100, "tpu-v5p": TPU_V5P}

"""XLA_FLAGS for a subprocess that needs several host devices: the suite's own flags (tests/conftest.py)
plus the device count, so that the child compiles as the parent does."""

import os


def xla_flags(devices: int) -> str:
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()

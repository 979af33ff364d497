"""Ops under jax.jit on sharded arrays (4 forced host devices, in a fresh interpreter): see
sharding_check.py for what is checked; single-device behaviour is unchanged (the other suites)."""

import os
import subprocess
import sys

import pytest

from bsr_jax.core import sharding
from tests import host_devices


def test_sharded_ops_match_per_shard_reference_on_four_devices():
    # XLA flags must be set before JAX starts, hence a fresh interpreter with 4 host devices.
    script = os.path.join(os.path.dirname(__file__), "sharding_check.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "XLA_FLAGS": host_devices.xla_flags(4), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, script], env=env, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 devices: sharding checks passed" in done.stdout


@pytest.mark.parametrize("names", [(), (1,)])
def test_batch_axes_rejects_non_names(names):
    with pytest.raises(ValueError, match="batch_axes"):
        with sharding.batch_axes(*names):
            pass

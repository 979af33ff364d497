"""Stochastic pruning draws fresh keys per training step and per device (a constant key would pass
every numerics test). Runs on 4 forced host devices in a fresh interpreter:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/train/test_pruning_keys.py

The probe: every device holds the same all-ones shard, one block-row by 8 equal block-columns, of
which a stochastic Dense keeps 1 (sparsity 0.875), chosen uniformly. dW's non-zero row bands name
the kept block-columns; after the data-parallel mean they are the union over devices. Equal keys on
every device give one band; per-device keys give several. Across steps of the real train step (SGD
with rate 1, so the update is -dW), a key that ignores the step gives the same bands every step.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import bsr_jax
from train import loop, sharding
from tests import host_devices

DEVICES, ROWS, BLOCK_COLUMNS, BK = 4, 8, 8, 4
DONE = "pruning keys: all checks passed"


def _probe():
    model = bsr_jax.Dense(3, use_bias=False, sparsity=1 - 1 / BLOCK_COLUMNS, block=(ROWS, BK), stochastic=True)

    def loss_fn(params, batch, rng):
        y = model.apply({"params": params}, batch["x"], rngs={"pruning": rng})
        return jnp.sum(y), {}  # dy = 1: dW's row k is the kept (rescaled) sum of input column k

    x = jnp.ones((DEVICES, ROWS, BLOCK_COLUMNS * BK))  # one example of ROWS tokens per device
    params = model.init(jax.random.key(0), x[:1])["params"]
    return loss_fn, params, {"x": x}


def _kept_columns(dw: np.ndarray) -> frozenset[int]:
    """Block-columns whose rows of dW are non-zero."""
    bands = np.abs(np.asarray(dw)).reshape(BLOCK_COLUMNS, BK, -1).sum((1, 2))
    return frozenset(np.flatnonzero(bands).tolist())


def main() -> int:
    assert len(jax.devices()) == DEVICES, f"expected {DEVICES} forced host devices, got {jax.devices()}"
    mesh = sharding.make_mesh()
    loss_fn, params, batch = _probe()
    batch = jax.device_put(batch, sharding.batch_sharding(mesh))

    # Per device: one step's gradient, averaged over the 4 shards.
    grad_fn = jax.jit(sharding.data_parallel_grad(loss_fn, mesh))
    _, grads = grad_fn(jax.device_put(params, sharding.replicated(mesh)), batch, jax.random.key(1))
    kept = _kept_columns(grads["kernel"])
    assert len(kept) > 1, f"all {DEVICES} devices kept the same block-column {sorted(kept)}: one key for every device"

    # Per step: the train step's own key schedule, read from the SGD updates.
    tx = optax.sgd(1.0)
    step = loop.make_train_step(loss_fn, tx, lambda count: 1.0, mesh, rng_seed=0)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
    state = jax.device_put(state, sharding.replicated(mesh))
    per_step = []
    for _ in range(4):
        before = np.asarray(state["params"]["kernel"])
        state, _ = step(state, batch)
        per_step.append(_kept_columns(before - np.asarray(state["params"]["kernel"])))
    assert len(set(per_step)) > 1, f"every step kept the same block-columns {sorted(per_step[0])}: one key for every step"
    print(DONE)
    return 0


def test_stochastic_pruning_keys_differ_per_step_and_per_device():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        **os.environ,
        "XLA_FLAGS": host_devices.xla_flags(DEVICES),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and DONE in done.stdout, done.stdout + done.stderr


if __name__ == "__main__":
    sys.exit(main())

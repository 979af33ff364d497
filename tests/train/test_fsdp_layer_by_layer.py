"""FSDP layer by layer (``train.sharding``, ``train.lm --scan --fsdp``) on 4 forced host devices, in a
fresh interpreter:

    XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_allow_excess_precision=false" \
        python tests/train/test_fsdp_layer_by_layer.py

A scanned bf16 LM's loss and gradients when each layer gathers its own parameters equal, bit for
bit, those of gathering every parameter at the start (excess precision off, so that XLA rounds to
bf16 where the program says in both programs), with and without int4 storage, remat and a remat
policy; the stacked layers are never split along their layer axis; and the forward pass keeps no
stack of bf16 kernels for the backward (the gathered parameters are gathered again, not kept),
except under compress_model's lean pass (int4 with its default ``lean``: each module runs under its
own ``jax.checkpoint``, which keeps its inputs, the gathered kernels among them; a known cost,
docs/training.md), which the same int4 run without ``lean`` shows. The child prints one JSON line of
what it saw; the test judges it.
"""

import json
import os
import subprocess
import sys

import pytest

from tests import host_devices

DEVICES = 4
CASES = {  # name -> LMConfig overrides
    "plain": {},
    "int4": {"storage_dtype": "int4"},
    "int4-not-lean": {"storage_dtype": "int4", "lean": False},
    "remat-dots-attention": {"remat": True, "remat_policy": "remat-dots-attention"},
}


def _scan_outputs(jaxpr) -> list[tuple[tuple[int, ...], str]]:
    """Shapes and dtypes of what every scan in ``jaxpr`` (nested too) returns."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            shapes += [(tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.outvars]
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                shapes += _scan_outputs(inner)
    return shapes


def main(names: list[str]) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from train import lm_loop, sharding
    from train.lm_config import LMConfig

    assert len(jax.devices()) == DEVICES, jax.devices()
    mesh = sharding.make_mesh()
    # 2 windows of 12 tokens per device: 24 rows, unlike any kernel dimension (32, 704)
    tokens = {"tokens": jax.random.randint(jax.random.key(1), (8, 13), 0, 260)}
    seen = {}
    for name in names:
        overrides = CASES[name]
        config = LMConfig(model="cpu", dim=32, depth=2, heads=2, seq_len=12, batch_size=8, vocab_size=260, dtype="bfloat16", scan=True,
                          fsdp=True, **overrides)  # fmt: skip
        shape = lm_loop.model_shape(config, config.vocab_size)
        state = lm_loop.initial_state(config, shape, lm_loop.create_optimizer(config, lm_loop.learning_rate_schedule(config)))()
        loss_fn = lm_loop.loss_function(lm_loop.create_model(config, shape), config)
        out = {}
        for layers in (None, lm_loop.stacked_layers(config)):
            placed = sharding.state_shardings(state["params"], mesh, True, layers)
            grad_fn = sharding.data_parallel_grad(loss_fn, mesh, True, layers)
            (loss, _), grads = jax.jit(grad_fn)(jax.device_put(state["params"], placed), tokens, jax.random.key(0))
            out[layers] = (float(loss), [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)])
        (whole_loss, whole), (layer_loss, by_layer) = out.values()
        stacked_specs = [list(map(str, s.spec)) for s in jax.tree.leaves(sharding.state_shardings(state["params"]["layers"], mesh, True, "layers"))]
        kernels = {(tuple(x.shape), "bfloat16") for x in jax.tree.leaves(state["params"]["layers"]) if x.ndim == 3}  # as the layers read them
        abstract = jax.eval_shape(lambda p: p, state["params"])
        jaxpr = jax.make_jaxpr(sharding.data_parallel_grad(loss_fn, mesh, True, "layers"))(abstract, tokens, jax.random.key(0)).jaxpr
        kept = [(shape, dtype) for shape, dtype in _scan_outputs(jaxpr) if (shape, dtype) in kernels]
        seen[name] = {"losses": [whole_loss, layer_loss], "max_grad_difference": max(float(np.abs(a - b).max()) for a, b in zip(whole, by_layer)),
                      "stacked_specs": stacked_specs, "kept_kernel_stacks": [[list(shape), dtype] for shape, dtype in kept],
                      "forward_scan_outputs": len(_scan_outputs(jaxpr))}  # fmt: skip
    print(json.dumps(seen))


# Plain and int4 (the lean pass's known cost) by default; the rest (12 s more) with -m slow.
@pytest.mark.parametrize("names", [("plain", "int4"), pytest.param(("int4-not-lean", "remat-dots-attention"), marks=pytest.mark.slow)],
                         ids=["plain,int4", "not-lean,remat"])  # fmt: skip
def test_gathering_layer_by_layer_gives_the_gradients_of_gathering_all_and_keeps_no_gathered_kernel(names):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "XLA_FLAGS": host_devices.xla_flags(DEVICES) + " --xla_allow_excess_precision=false", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    done = subprocess.run([sys.executable, __file__, *names], env=env, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(seen) == set(names)
    for name, case in seen.items():
        whole, by_layer = case["losses"]
        assert whole == by_layer, name
        assert case["max_grad_difference"] == 0.0, name
        # Every stacked leaf is split along a dimension other than the layer axis (or kept whole).
        assert all(spec[:1] != ["data"] for spec in case["stacked_specs"]), (name, case["stacked_specs"])
        assert any("data" in spec for spec in case["stacked_specs"]), name
        assert case["forward_scan_outputs"] > 0, name  # the check below looked at the scans' residuals
        if name == "int4":  # the lean pass's checkpoints keep their inputs, the gathered kernels among them
            assert len(case["kept_kernel_stacks"]) == 7, case["kept_kernel_stacks"]  # q, k, v, o, gate, up, down: docs/training.md
        else:
            assert case["kept_kernel_stacks"] == [], (name, case["kept_kernel_stacks"])


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))

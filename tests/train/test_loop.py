"""The train loop: optimizer pieces, a learning step, resume bit-for-bit, signals, NaN, bookkeeping.

The data layer is replaced by small generated arrays (``train.data.load_split`` is patched), so
these tests exercise the loop alone; tests/train/test_cli.py runs the real data path end to end.
"""

import json
import os
import signal
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import data, loop, metrics, sharding
from tests import host_devices
from train.checkpoint import Checkpoints
from train.config import TrainConfig, UsageError

TINY = dict(dim=16, depth=1, image_size=8, patch_size=4, batch_size=16, eval_batch_size=16, log_every=2)


def learnable_split(n: int, seed: int) -> data.ArrayDataset:
    """8x8 images whose mean colour gives the class (4 classes), plus noise."""
    rng = np.random.default_rng(seed)
    labels = (np.arange(n) % 4).astype(np.int32)
    colours = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40]])
    images = colours[labels][:, None, None, :] + rng.integers(-30, 30, size=(n, 8, 8, 3))
    return data.ArrayDataset(images.clip(0, 255).astype(np.uint8), labels, num_classes=4)


@pytest.fixture
def generated_data(monkeypatch):
    splits = {"train": learnable_split(64, 0), "test": learnable_split(24, 1)}
    monkeypatch.setattr(data, "load_split", lambda dataset, split, **kw: splits[split])
    return splits


def config(**overrides) -> TrainConfig:
    return TrainConfig(**{**TINY, "epochs": 2, "warmup_epochs": 0.0, "lr": 3e-3, **overrides})


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_decay_mask_decays_kernels_only():
    cfg = config()
    model = loop.create_model(cfg, num_classes=4)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
    mask = loop.decay_mask(params)
    flat = {"/".join(k.key for k in path): v for path, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert flat["block0/fc1/kernel"] and flat["stem/kernel"] and flat["head/kernel"]
    assert not any(v for k, v in flat.items() if not k.endswith("kernel"))
    assert {k.split("/")[-1] for k, v in flat.items() if not v} == {"bias", "alpha", "beta", "scale"}


def test_schedule_warms_up_then_decays_to_min_lr():
    schedule = loop.learning_rate_schedule(config(epochs=10, warmup_epochs=1.0, lr=1e-2, min_lr=1e-5), steps_per_epoch=4)
    assert schedule(0) == 0.0 and np.isclose(schedule(4), 1e-2) and np.isclose(schedule(40), 1e-5)
    # Warmup is capped at 20% of the run.
    capped = loop.learning_rate_schedule(config(epochs=2, warmup_epochs=5.0, lr=1e-2), steps_per_epoch=10)
    assert np.isclose(capped(4), 1e-2) and capped(3) < 1e-2


def test_train_steps_decrease_the_loss(generated_data):
    cfg = config(sparsity=0.7, block=4)
    mesh = sharding.make_mesh()
    model = loop.create_model(cfg, num_classes=4)
    schedule = loop.learning_rate_schedule(cfg, steps_per_epoch=4)
    tx = loop.create_optimizer(cfg, schedule)
    state = loop.create_state(model, tx, (16, 8, 8, 3), seed=0, mesh=mesh)
    step = loop.make_train_step(loop.loss_function(model, 4, 0.0), tx, schedule, mesh)
    batch = next(data.train_batches(generated_data["train"], 16, seed=0, epoch=0, augment="none"))
    losses = []
    for _ in range(12):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state["step"]) == 12
    assert losses[-1] < 0.5 * losses[0], losses


def test_kept_block_fraction_counts_rounded_capacities():
    cfg = config(sparsity=0.7, block=4, dim=16)
    model = loop.create_model(cfg, num_classes=4)
    images = jax.ShapeDtypeStruct((16, 8, 8, 3), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), images)["params"]
    # Tokens (16, 4, 16): token mixing sees (16*16, 4) -> 64x1 blocks keep ceil(0.3*64) = 20;
    # fc1 sees (64, 16) -> 16x4 blocks keep 20; fc2 sees (64, 64) -> 16x16 blocks keep 77.
    assert metrics.kept_block_fraction(model, params, images) == (20 + 20 + 77) / (64 + 64 + 256)
    dense = loop.create_model(config(), num_classes=4)
    assert metrics.kept_block_fraction(dense, params, images) == 1.0


def final_params(workdir):
    checkpoints = Checkpoints(os.path.join(workdir, "checkpoints"))
    step = checkpoints.latest_step()
    return step, checkpoints.restore(_state_like(), step)["params"]


def _state_like():
    cfg = config()
    model = loop.create_model(cfg, num_classes=4)
    tx = loop.create_optimizer(cfg, loop.learning_rate_schedule(cfg, 4))
    return jax.eval_shape(lambda: loop.create_state(model, tx, (16, 8, 8, 3), 0, sharding.make_mesh()))


# The second case resumes in the middle of a sparsity warmup, with stochastic int8 blocks.
@pytest.mark.parametrize(
    "pruning",
    [
        pytest.param({}, id="dense"),
        # 30 s on 2 cores; the dense case runs by default, keys per step are tested in test_pruning_keys.
        pytest.param(
            dict(sparsity=0.5, block=4, stochastic=True, storage_dtype="int8", sparsity_warmup_epochs=1.0),
            id="stochastic-warmup",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_resume_continues_bit_for_bit(generated_data, tmp_path, pruning):
    # 2 epochs of 4 steps; the interrupted run stops mid-epoch, so resuming needs epoch and batch.
    full = loop.train_and_evaluate(config(log_every=1, **pruning), str(tmp_path / "full"))
    first = loop.train_and_evaluate(config(steps=3, log_every=1, **pruning), str(tmp_path / "split"))
    assert first["step"] == 3 and first["stopped_by"] is None
    second = loop.train_and_evaluate(config(resume=True, log_every=1, **pruning), str(tmp_path / "split"))
    assert full["step"] == second["step"] == 8
    step_full, params_full = final_params(tmp_path / "full")
    step_split, params_split = final_params(tmp_path / "split")
    assert step_full == step_split == 8
    chex.assert_trees_all_equal(params_split, params_full)
    assert second["eval"] == full["eval"]
    # The resumed log holds each step once, the same records as the uninterrupted run (timings aside).
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("step_time_s", "images_per_s")} for r in rs if r["kind"] != "memory"]
    records_split = read_jsonl(tmp_path / "split" / "metrics.jsonl")
    assert [r for r in strip(records_split) if r["step"] > 3] == [r for r in strip(read_jsonl(tmp_path / "full" / "metrics.jsonl")) if r["step"] > 3]


def test_layer_sparsity_rules_reach_only_matching_layers():
    model = loop.create_model(config(), num_classes=4)
    batch = {"image": jnp.asarray(learnable_split(16, 0).images, jnp.float32) / 255, "label": jnp.arange(16) % 4}
    params = model.init(jax.random.key(0), batch["image"])["params"]
    grads = lambda rules: jax.jit(jax.grad(lambda p: loop.loss_function(model, 4, 0.0, rules)(p, batch)[0]))(params)  # jitted: one compile each
    plain, ruled = grads(()), grads((("block0/fc1", 0.75),))
    chex.assert_trees_all_equal(ruled["block0"]["fc2"], plain["block0"]["fc2"])
    assert not jnp.allclose(ruled["block0"]["fc1"]["kernel"], plain["block0"]["fc1"]["kernel"])


def test_sigterm_checkpoints_and_stops(generated_data, tmp_path, monkeypatch):
    batches = data.train_batches

    def signalling_batches(*args, **kwargs):
        for i, batch in enumerate(batches(*args, **kwargs)):
            if i == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    monkeypatch.setattr(data, "train_batches", signalling_batches)
    result = loop.train_and_evaluate(config(), str(tmp_path))
    assert result["stopped_by"] == signal.SIGTERM
    assert 1 <= result["step"] <= 3  # one step in flight: the run does not drain a queue of dispatched steps
    assert Checkpoints(str(tmp_path / "checkpoints")).latest_step() == result["step"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    assert result["summary"]["stopped_by"] == signal.SIGTERM and result["summary"]["step"] == result["step"]


def test_signal_during_evaluation_drops_it_and_resume_redoes_it(generated_data, tmp_path, monkeypatch):
    eval_batches, calls = data.eval_batches, []

    def interrupted(*args, **kwargs):
        calls.append(None)
        for i, batch in enumerate(eval_batches(*args, **kwargs)):
            if len(calls) == 1 and i == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    monkeypatch.setattr(data, "eval_batches", interrupted)
    stopped = loop.train_and_evaluate(config(eval_batch_size=8), str(tmp_path))  # 3 eval batches
    assert stopped["stopped_by"] == signal.SIGTERM and stopped["step"] == 4 and "eval" not in stopped
    resumed = loop.train_and_evaluate(config(eval_batch_size=8, resume=True), str(tmp_path))
    assert resumed["stopped_by"] is None and resumed["step"] == 8
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in records if r["kind"] != "train"] == [("memory", 0), ("memory", 4), ("eval", 4), ("eval", 8)]
    evals = [r["test_accuracy"] for r in records if r["kind"] == "eval"]
    summary = resumed["summary"]
    assert (summary["final_test_accuracy"], summary["best_test_accuracy"]) == (evals[-1], max(evals))
    assert summary["checkpoint"] == str(tmp_path / "checkpoints" / "8")
    assert summary["residual_activation_mib"] == summary["dense_residual_activation_mib"]  # config() is dense


def test_resume_refuses_other_settings_and_leaves_a_finished_run_alone(generated_data, tmp_path):
    loop.train_and_evaluate(config(steps=2, sparsity=0.5, block=4), str(tmp_path))
    files = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    again = loop.train_and_evaluate(config(steps=2, sparsity=0.5, block=4, resume=True), str(tmp_path))
    assert again == {"step": 2, "stopped_by": None, "summary": None}
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == files
    with pytest.raises(UsageError, match=r"--sparsity 0.7 \(the run has 0.5\)"):
        loop.train_and_evaluate(config(steps=4, sparsity=0.7, block=4, resume=True), str(tmp_path))
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == files


def test_nan_loss_fails_loudly(generated_data, tmp_path, monkeypatch):
    batches = data.train_batches

    def poisoned(*args, **kwargs):
        for batch in batches(*args, **kwargs):
            batch["image"][0, 0, 0, 0] = np.nan
            yield batch

    monkeypatch.setattr(data, "train_batches", poisoned)
    with pytest.raises(FloatingPointError, match="at step 1"):
        loop.train_and_evaluate(config(), str(tmp_path))


def test_writes_config_memory_and_refuses_to_overwrite(generated_data, tmp_path):
    result = loop.train_and_evaluate(config(steps=2, sparsity=0.5, block=4), str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["config"] == config(steps=2, sparsity=0.5, block=4).to_json()
    assert saved["run"]["steps_per_epoch"] == 4 and saved["run"]["devices"] == jax.device_count()
    memory = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert memory["kind"] == "memory" and memory == {"step": 0, **result["memory"]}
    assert memory["residual_activation_mib"] > 0 and memory["compiled_peak_mib"] > 0
    assert memory["kept_block_fraction"] == pytest.approx(0.5, abs=0.02)
    with pytest.raises(UsageError, match="--resume"):
        loop.train_and_evaluate(config(steps=2), str(tmp_path))


@pytest.mark.slow  # test_sharding (every op on 4 devices), test_resnet's and test_lm_fsdp's 4-device steps hold the claim
def test_data_parallel_matches_single_device():
    # XLA flags must be set before JAX starts, hence a fresh interpreter with 4 host devices.
    script = os.path.join(os.path.dirname(__file__), "data_parallel_check.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        **os.environ,
        "XLA_FLAGS": host_devices.xla_flags(4),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, script], env=env, cwd=root, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 devices: all checks passed" in done.stdout

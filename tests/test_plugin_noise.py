"""No plugin noise on a machine without an accelerator (bsr_jax/_environment.py), as a user runs
the README's commands: nothing in the environment set, the ``test`` extra's CUDA plugin and libtpu
installed. The subprocess tests compare raw stderr, unfiltered; the unit tests check when the
defaults apply and that a user's own settings and a machine with a GPU are left alone.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from bsr_jax import _environment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a user's shell has: none of the variables the suite (conftest) or _environment set.
_SET_HERE = ("JAX_PLATFORMS", "BSR_JAX_CACHE", *_environment._TPU_TOPOLOGY_VARS)
needs_cpu_only_machine = pytest.mark.skipif(
    _environment.accelerator_visible(), reason="the defaults apply only where no accelerator is visible"
)
needs_plugins = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("libtpu") is None,
    reason="the aot extra (jax's CUDA plugin, libtpu) is not installed",
)


def _run(args: list[str], tmp_path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _SET_HERE}
    env.update(HOME=str(tmp_path / "home"), TFDS_DATA_DIR=str(tmp_path / "tfds"))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


@needs_cpu_only_machine
def test_importing_bsr_jax_and_running_jax_prints_nothing(tmp_path):
    done = _run(["-c", "import bsr_jax; import jax; jax.numpy.ones(1).block_until_ready()"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


@needs_cpu_only_machine
def test_jax_imported_first_is_quiet_too(tmp_path):
    code = "import jax; import bsr_jax; jax.numpy.ones(1).block_until_ready(); print(jax.default_backend())"
    done = _run(["-c", code], tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "cpu\n", "")


@needs_cpu_only_machine
def test_a_training_data_error_prints_only_its_message(tmp_path):
    done = _run(["-m", "train.cifar", "--data-dir", str(tmp_path / "nowhere"), "--steps", "1",
                 "--workdir", str(tmp_path / "run")], tmp_path)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    # The message's first line, then its indented continuation lines: nothing before, nothing else.
    assert lines[0].startswith("train.cifar: "), done.stderr
    assert all(line.startswith("  ") for line in lines[1:]), done.stderr


@needs_cpu_only_machine
@needs_plugins
def test_deviceless_targets_compile_quietly_with_nothing_set(tmp_path):
    # JAX_PLATFORMS unset by the user: the CUDA plugin must still register (H100), libtpu still load.
    code = (
        "import bsr_jax, jax, jax.numpy as jnp\n"
        "f = jax.jit(lambda w, x: jnp.sum((x @ w) ** 2))\n"
        "for t in ('h100', 'tpu-v5p'):\n"
        "    print(t, bsr_jax.compiled_memory(f, jnp.ones((128, 128)), jnp.ones((64, 128)), target=t).peak > 0)\n"
    )
    done = _run(["-c", code], tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "h100 True\ntpu-v5p True\n", "")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A Linux machine without an accelerator, the CUDA plugin and libtpu installed, nothing set; the
    test changes what it needs. set_defaults() writes os.environ, which monkeypatch restores."""
    for name in _SET_HERE:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(_environment, "_NVIDIA_DEVICES", (str(tmp_path / "nvidia0"),))
    monkeypatch.setattr(_environment, "_AMD_DEVICES", (str(tmp_path / "kfd"),))
    monkeypatch.setattr(_environment, "tpu_visible", lambda: False)
    monkeypatch.setattr(_environment, "_installed_plugins", lambda: {"jax_plugins.xla_cuda12"})
    monkeypatch.setattr(_environment, "_libtpu_installed", lambda: True)
    monkeypatch.setattr(_environment, "_tell_started_jax", lambda platforms: None)  # this process's jax runs
    return tmp_path


def _after_defaults() -> dict[str, str | None]:
    _environment.set_defaults()
    return {name: os.environ.get(name) for name in ("JAX_PLATFORMS", "TPU_HOST_BOUNDS", "TPU_WORKER_HOSTNAMES")}


def test_without_an_accelerator_jax_starts_the_cpu_and_libtpu_this_host(machine):
    assert _after_defaults() == {"JAX_PLATFORMS": "cpu", "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost"}


def test_a_visible_gpu_is_left_to_jax(machine):
    (machine / "nvidia0").touch()
    assert _after_defaults()["JAX_PLATFORMS"] is None


def test_a_visible_tpu_is_left_to_jax_and_libtpu(machine, monkeypatch):
    monkeypatch.setattr(_environment, "tpu_visible", lambda: True)
    assert _after_defaults() == {"JAX_PLATFORMS": None, "TPU_HOST_BOUNDS": None, "TPU_WORKER_HOSTNAMES": None}


def test_the_users_settings_win(machine, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "")  # empty: jax's own choice
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-8")
    assert _after_defaults() == {"JAX_PLATFORMS": "", "TPU_HOST_BOUNDS": None, "TPU_WORKER_HOSTNAMES": None}


def test_an_unknown_plugin_is_left_to_jax(machine, monkeypatch):
    monkeypatch.setattr(_environment, "_installed_plugins", lambda: {"jax_plugins.xla_cuda12", "other_xpu_plugin"})
    assert _after_defaults()["JAX_PLATFORMS"] is None


def test_without_the_plugins_nothing_is_set(machine, monkeypatch):
    monkeypatch.setattr(_environment, "_installed_plugins", lambda: set())
    monkeypatch.setattr(_environment, "_libtpu_installed", lambda: False)
    assert _after_defaults() == {"JAX_PLATFORMS": None, "TPU_HOST_BOUNDS": None, "TPU_WORKER_HOSTNAMES": None}


def test_other_systems_are_left_alone(machine, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _after_defaults() == {"JAX_PLATFORMS": None, "TPU_HOST_BOUNDS": None, "TPU_WORKER_HOSTNAMES": None}


def test_environment_module_does_not_import_jax(tmp_path):
    # train/__init__.py runs it before --help, which must not pay for importing jax.
    code = "import os, sys, train; assert 'jax' not in sys.modules, 'jax imported'; print(os.environ.get('JAX_PLATFORMS'))"
    done = _run(["-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    if not _environment.accelerator_visible():
        assert done.stdout == "cpu\n"  # set before the suite imports jax

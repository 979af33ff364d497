"""Defaults for jax's environment, set before jax starts: on a machine without an accelerator, no
plugin noise, while deviceless compiles for an H100 or a TPU (``bsr_jax.measure.compiled``) still work.

The ``aot`` extra (part of ``test``) installs jax's CUDA plugin and libtpu. Without an accelerator,
jax's first operation starts every platform it finds: the CUDA plugin fails its driver check (a
logged traceback ending "Unable to load CUDA. Is it installed?") and libtpu, finding no TPU and no
metadata server, logs that it cannot determine the accelerator type and ``TPU_WORKER_HOSTNAMES``.
So, each only where the user has not set it:

* ``JAX_PLATFORMS=cpu`` on Linux when no NVIDIA, AMD or TPU device is visible (the checks of jax's
  ``jax._src.hardware_utils``), the CUDA plugin or libtpu is installed, and no other jax plugin is:
  jax starts the CPU only. The CUDA plugin still registers, skipping its driver check, which is
  what a deviceless H100 compile needs, and libtpu loads only when a TPU topology is asked for.
  ``JAX_PLATFORMS=`` (empty) keeps jax's own choice. A machine with a GPU or TPU is left alone.
* ``TPU_HOST_BOUNDS=1,1,1`` and ``TPU_WORKER_HOSTNAMES=localhost`` when libtpu is installed, no TPU
  is visible and no TPU topology variable is set: the single host that libtpu otherwise looks up on
  a Cloud TPU VM's metadata server, so a deviceless TPU compile logs nothing.

The CUDA plugin's ``cudart_stub.cc`` lines "Could not find cuda drivers on your machine", logged
while jax is imported, are not an environment matter: they appear when ``libcudart`` is missing,
and the ``aot`` extra installs it (nvidia-cuda-runtime-cu12).

Run at import by ``bsr_jax/__init__.py`` before it imports jax, and by ``train/__init__.py`` before
the training suite does. Where jax was imported first but has started no backend yet, the platform
choice goes to ``jax.config`` too. The variables are set in ``os.environ``, so subprocesses on the
same machine inherit them. Standard library only: importing this module must not import jax.
"""

from __future__ import annotations

import glob
import os
import sys

# jax._src.hardware_utils: device files of a visible NVIDIA GPU (/dev/dxg: WSL2), TPU PCI ids.
_NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
_AMD_DEVICES = ("/dev/kfd",)
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")
# Plugins whose failure without their device is the noise this module removes.
_QUIET_PLUGINS = {"jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"}
_TPU_TOPOLOGY_VARS = ("TPU_HOST_BOUNDS", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE",
                      "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_PROCESS_ADDRESSES")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def tpu_visible() -> bool:
    """A TPU chip on this host's PCI bus (or a TPU device file)."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        if _read(vendor) == _GOOGLE_PCI_VENDOR:
            if _read(os.path.join(os.path.dirname(vendor), "device")) in _TPU_PCI_DEVICES:
                return True
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def accelerator_visible() -> bool:
    """Whether jax could find a GPU or TPU here: device files of NVIDIA or AMD GPUs, or a TPU."""
    return any(os.path.exists(d) for d in _NVIDIA_DEVICES + _AMD_DEVICES) or tpu_visible()


def _installed_plugins() -> set[str]:
    """The jax plugin modules jax's discovery would load (the ``jax_plugins`` namespace package and
    the ``jax_plugins`` entry points)."""
    import importlib.util
    import pkgutil
    from importlib.metadata import entry_points

    found = set()
    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        found |= {f"jax_plugins.{name}" for _, name, _ in pkgutil.iter_modules(spec.submodule_search_locations)}
    found |= {ep.value for ep in entry_points(group="jax_plugins")}
    return found


def _libtpu_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None or bool(os.environ.get("TPU_LIBRARY_PATH"))


def _tell_started_jax(platforms: str) -> None:
    """jax imported before us reads JAX_PLATFORMS no more: set its config while no backend runs."""
    if "jax" not in sys.modules:
        return
    try:
        from bsr_jax.core.jax_private import config, xla_bridge

        if config.jax_platforms.value is None and not xla_bridge.backends_are_initialized():
            config.update("jax_platforms", platforms)
    except (ImportError, AttributeError):  # a jax without these internals: leave it
        pass


def set_defaults() -> None:
    """Set the defaults described in the module docstring; idempotent."""
    if not sys.platform.startswith("linux"):
        return  # the CUDA plugin and libtpu are Linux-only; Metal and others are left alone
    libtpu = _libtpu_installed()
    if not tpu_visible() and libtpu and not any(v in os.environ for v in _TPU_TOPOLOGY_VARS):
        os.environ["TPU_HOST_BOUNDS"] = "1,1,1"
        os.environ["TPU_WORKER_HOSTNAMES"] = "localhost"
    if "JAX_PLATFORMS" in os.environ or accelerator_visible():
        return
    plugins = _installed_plugins()
    if plugins - _QUIET_PLUGINS or not (plugins or libtpu):
        return  # a plugin we do not know (its device may be one we cannot see), or nothing to quiet
    os.environ["JAX_PLATFORMS"] = "cpu"
    _tell_started_jax("cpu")


set_defaults()

"""The training suite (``python -m train.cifar``, ``train.imagenet``, ``train.plot``)."""

import importlib.util as _util
import os as _os
import sys as _sys


def _jax_environment() -> None:
    """bsr_jax's defaults for jax's environment (``bsr_jax/_environment.py``: no plugin noise on a
    machine without an accelerator), set before anything here imports jax. Loaded from its file:
    importing it through the ``bsr_jax`` package would import jax (and flax) first, which ``--help``
    and usage errors do not need."""
    if "bsr_jax._environment" in _sys.modules:
        return
    package = _util.find_spec("bsr_jax")
    if package is None or not package.submodule_search_locations:
        return
    path = _os.path.join(package.submodule_search_locations[0], "_environment.py")
    spec = _util.spec_from_file_location("bsr_jax_environment", path)
    if spec is None or spec.loader is None:
        return
    spec.loader.exec_module(_util.module_from_spec(spec))


_jax_environment()

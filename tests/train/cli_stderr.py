"""What a CLI subprocess wrote to stderr itself, without the lines JAX's plugins print at import.

The deviceless-compile plugins of the `test` extra (jax-cuda12-plugin, libtpu) and CUDA builds of
jaxlib log at every JAX import, JAX_PLATFORMS=cpu or not: absl's "WARNING: All log messages before
absl::InitializeLog() ..." banner and glog-style lines such as "I0000 00:00:... cudart_stub.cc:31]
Could not find cuda drivers on your machine". Tests that assert an empty or short stderr compare
``ours(stderr)`` instead. A plain module (like checkpoint_scores), since test modules cannot import
conftest.
"""

from __future__ import annotations

import re

# absl's banner; glog lines "[IWEF]MMDD hh:mm:ss.uuuuuu  tid file:line] ..." (absl uses 0000 for
# the date before InitializeLog).
_PLUGIN_LOG = re.compile(r"WARNING: All log messages before absl::InitializeLog\(\)|[IWEF]\d{4} \d\d:\d\d:[\d.]+ +\d+ \S+:\d+\] ")


def ours(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are not plugin/absl log lines."""
    return [line for line in stderr.splitlines() if not _PLUGIN_LOG.match(line)]

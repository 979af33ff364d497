"""Train a decoder-only transformer LM on real text with compressed activation residuals.

Example: python -m train.lm --steps 200                    (the cpu preset, 7.4M params: ~10 minutes on 2 busy CPU cores)
         python -m train.lm --storage-dtype int4 --block 16 (every linear's residual in int4 blocks)
The text is this Python's own standard library (its *.py files; 5% of them, by path hash, held out
for validation), tokenized by a byte-level BPE of 8192 tokens trained on the training files and
cached (~/.cache/bsr_jax/lm); --data-dir reads any folder of text files instead, --tokenizer bytes
uses UTF-8 bytes. Layers stack as a Python loop or (--scan) with nn.scan, optionally under
nn.remat (--remat); every linear layer is compressed through bsr_jax.compress_model;
--loss-chunk N computes the head and cross-entropy N tokens at a time (bsr_jax.ops.losses: the
(B, T, V) logits never exist).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from train import cli

PROG = "train.lm"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one training; returns the process exit code (``train.cli.EXIT_CODES``)."""
    from train.lm_config import parse

    config, workdir, overrides = parse(PROG, cli.with_exit_codes(__doc__), argv)
    if config.resume and overrides:
        print(f"{PROG}: resuming {workdir} with its config.json, changing {', '.join(overrides)}")
    return cli.run_interruptible(PROG, workdir, lambda: _run(config, workdir))


def _run(config, workdir: str) -> int:
    # Imported after parsing, so --help and flag errors do not wait for JAX to start.
    from train.data_sources import DataError
    from train.lm_config import UsageError
    from train.lm_loop import train_and_evaluate
    from train.run_dir import DamagedConfig, DamagedRecords

    try:
        result = train_and_evaluate(config, workdir)
    except (DataError, UsageError, DamagedRecords, DamagedConfig) as error:
        return cli.refused(PROG, error)
    return 0 if result["stopped_by"] is None else 128 + result["stopped_by"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

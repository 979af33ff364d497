"""Train a decoder-only transformer LM on real text with compressed activation residuals.

Example: python -m train.lm --steps 200                    (the cpu preset, 7.4M params: ~10 minutes on 2 busy CPU cores)
         python -m train.lm --storage-dtype int4 --block 16 (every linear's residual in int4 blocks)
The text is this Python's own standard library (its *.py files; 5% of them, by path hash, held out
for validation), tokenized by a byte-level BPE of 8192 tokens trained on the training files and
cached (~/.cache/bsr_jax/lm); --data-dir reads any folder of text files instead, --tokenizer bytes
uses UTF-8 bytes. Layers stack as a Python loop or (--scan) with nn.scan, optionally under
nn.remat (--remat); every linear layer is compressed through bsr_jax.compress_model;
--loss-chunk N computes the head and cross-entropy N tokens at a time (bsr_jax.losses: the
(B, T, V) logits never exist).
Exit codes: 0 done, 2 a bad flag or unreadable data (one line on stderr), 128 + signal when
SIGINT/SIGTERM stopped it: in training after a checkpoint (--resume continues it bit for bit),
before (JAX starting, the corpus and tokenizer being prepared) with one line on stderr.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

from train import cli, run_dir

PROG = "train.lm"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one training; returns the process exit code (see the module docstring)."""
    from train.lm_config import parse

    config, workdir, overrides = parse(PROG, __doc__, argv)
    if config.resume and overrides:
        print(f"{PROG}: resuming {workdir} with its config.json, changing {', '.join(overrides)}")
    # SIGINT/SIGTERM before the loop's own handlers (train.stopping) are installed, or after: while
    # JAX starts or the corpus and tokenizer are prepared. Both go through train.cli's recording
    # handler (as train.cifar's do), so a signal whose exception Python raised inside jax's gc
    # callback (which swallows it) still stops the run at its next error.
    previous = {signum: signal.signal(signum, cli._raise_interrupted) for signum in (signal.SIGINT, signal.SIGTERM)}
    cli._received.clear()
    try:
        return _run(config, workdir)
    except (KeyboardInterrupt, cli._Interrupted) as interrupt:
        signum = interrupt.signum if isinstance(interrupt, cli._Interrupted) else signal.SIGINT
        saved = run_dir.latest_checkpoint_step(workdir)
        after = ("before the first step; run it again" if saved is None
                 else f"before training went on; its last checkpoint is step {saved}: continue with --resume")  # fmt: skip
        print(f"{PROG}: stopped by {signal.Signals(signum).name} {after}", file=sys.stderr)
        return 128 + signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run(config, workdir: str) -> int:
    # Imported after parsing, so --help and flag errors do not wait for JAX to start.
    from train.data_sources import DataError
    from train.lm_config import UsageError
    from train.lm_loop import train_and_evaluate
    from train.run_dir import DamagedRecords

    try:
        result = train_and_evaluate(config, workdir)
    except (DataError, UsageError, DamagedRecords) as error:
        if cli._received:  # the signal's exception was swallowed (raised inside a gc callback): it stops the run
            raise cli._Interrupted(cli._received[0]) from None
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    return 0 if result["stopped_by"] is None else 128 + result["stopped_by"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

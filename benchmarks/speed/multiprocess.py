"""A training run over several processes equals one process with the same devices.

    python -m benchmarks.speed.multiprocess [--data-dir DIR] [--steps 5] [--keep DIR]

Runs ``python -m train.cifar --steps 5`` (tiny ResMLP, width 16, one block, sparsity 0.7, batch 8)
twice on 4 host CPU devices: 1 process x 4 devices, and 2 processes x 2 devices joined by
``jax.distributed`` on localhost (``--coordinator localhost:PORT --num-processes 2 --process-id
I``). Prints each step's loss in both runs and the largest difference of the final train state
(params, optimizer state), and writes benchmarks/results/multiprocess.json. The default data is
the real CIFAR-10 (/work/shared/data/cifar10-jpg.tar.gz, an image folder; decoded once into the
cache). ``launch``, ``step_records`` and ``final_state`` serve tests/train/test_multiprocess.py.

Why a tolerance and not bit equality: the two layouts hold the same rows on the same devices and
prune the same per-device shards, but the all-reduces (the mean loss, the gradients) sum the 4
devices' parts in another order (inside one process vs gloo across processes), so float32 results
differ by a rounding (measured on CIFAR-10: losses up to 1.3e-7 apart relatively, final params and
optimizer state up to 4e-9 absolutely).

Writes docs/sharding.md's last section.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from benchmarks.run_info import run_metadata, write_json
from train import run_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "multiprocess.json")
REAL_DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "cifar10-jpg.tar.gz")
TINY_RUN = ("--dim", "16", "--depth", "1", "--batch-size", "8", "--eval-batch-size", "4", "--sparsity", "0.7",
            "--block", "16", "--log-every", "1")  # fmt: skip
# Float32 rounding of the all-reduce's order (see the module docstring), over 5 Adam steps.
LOSS_TOLERANCE = dict(rtol=1e-6, atol=0.0)
STATE_TOLERANCE = dict(rtol=1e-5, atol=1e-7)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(
    args: list[str], num_processes: int, devices_per_process: int, env: dict[str, str] | None = None, timeout_s: float = 300
) -> list[subprocess.CompletedProcess]:
    """Run ``python *args`` (e.g. ``["-m", "train.cifar", ...]``) as ``num_processes`` processes
    of one run, each with ``devices_per_process`` host CPU devices and, with several, the flags
    ``--coordinator localhost:PORT --num-processes N --process-id I``; from the repository root.
    Returns them in process order; all are killed if one is not done after ``timeout_s``."""
    env = {**(os.environ if env is None else env), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}"}  # fmt: skip
    joined = []
    if num_processes > 1:
        coordinator = f"localhost:{free_port()}"
        joined = [["--coordinator", coordinator, "--num-processes", str(num_processes), "--process-id", str(i)]
                  for i in range(num_processes)]  # fmt: skip
    commands = [[sys.executable, *args, *extra] for extra in joined or [[]]]
    # Output goes to files, not pipes: a process blocked on a full pipe would stall its peers' collectives.
    outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    processes = [subprocess.Popen(c, env=env, cwd=ROOT, stdout=out, stderr=err, text=True) for c, (out, err) in zip(commands, outputs)]
    deadline = time.monotonic() + timeout_s
    try:
        for process in processes:
            process.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:  # the others may be waiting for it: stop them all, report all
        for process in processes:
            process.kill()
            process.wait()
    finished = []
    for process, command, (out, err) in zip(processes, commands, outputs):
        out.seek(0), err.seek(0)
        finished.append(subprocess.CompletedProcess(command, process.returncode, out.read(), err.read()))
        out.close(), err.close()
    return finished


def step_records(workdir: str) -> list[dict]:
    """The ``train`` and ``eval`` records of ``workdir/metrics.jsonl``, without timings."""
    timing = ("step_time_s", "images_per_s")
    return [{k: v for k, v in r.items() if k not in timing} for r in run_dir.read_records(workdir) if r["kind"] in ("train", "eval")]


def final_state(workdir: str) -> dict:
    """The latest checkpoint's train state as numpy arrays (restored onto this process's first device)."""
    step = run_dir.latest_checkpoint_step(workdir)
    path = os.path.join(run_dir.checkpoint_dir(os.path.abspath(workdir)), str(step), "default")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.metadata(path).item_metadata.tree
        like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)
        return jax.device_get(checkpointer.restore(path, like))


def compare(single: str, multi: str) -> dict:
    """Per-step losses and final test accuracies of both runs, the largest absolute difference of
    their final states, and whether those agree within ``STATE_TOLERANCE``."""
    records = [step_records(w) for w in (single, multi)]
    losses = [[r["loss"] for r in rs if r["kind"] == "train"] for rs in records]
    accuracies = [[r["test_accuracy"] for r in rs if r["kind"] == "eval"][-1] for rs in records]
    a, b = (jax.tree.leaves(final_state(w)) for w in (single, multi))
    return {
        "losses_1x4": losses[0],
        "losses_2x2": losses[1],
        "test_accuracy_1x4": accuracies[0],
        "test_accuracy_2x2": accuracies[1],
        "max_abs_state_diff": max(float(np.max(np.abs(np.asarray(x, np.float64) - y), initial=0)) for x, y in zip(a, b)),
        "state_within_tolerance": all(np.allclose(x, y, **STATE_TOLERANCE) for x, y in zip(a, b)),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=REAL_DATA)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--keep", default="runs/multiprocess", help="where the two workdirs go (replaced)")
    args = parser.parse_args(argv)
    meta = run_metadata()
    workdirs = {layout: os.path.abspath(os.path.join(args.keep, layout)) for layout in ("1x4", "2x2")}
    for layout, workdir in workdirs.items():
        shutil.rmtree(workdir, ignore_errors=True)
        processes, devices = map(int, layout.split("x"))
        # --eval-batch-size 1000: 10 batches over CIFAR's 10,000 test images, not 2,500.
        flags = [*TINY_RUN, "--eval-batch-size", "1000", "--data-dir", args.data_dir, "--steps", str(args.steps)]
        for done in launch(["-m", "train.cifar", *flags, "--workdir", workdir], processes, devices):
            if done.returncode:
                print(done.stdout, done.stderr, file=sys.stderr)
                return 1
    result = compare(workdirs["1x4"], workdirs["2x2"])
    print("step  loss 1x4      loss 2x2")
    for step, (x, y) in enumerate(zip(result["losses_1x4"], result["losses_2x2"]), 1):
        print(f"{step:4d}  {x:.7f}  {y:.7f}")
    print(f"test accuracy after {args.steps} steps: {result['test_accuracy_1x4']:.4f} / {result['test_accuracy_2x2']:.4f}")
    print(f"final state: max |diff| {result['max_abs_state_diff']:.3g}, "
          f"within rtol {STATE_TOLERANCE['rtol']:g} atol {STATE_TOLERANCE['atol']:g}: {result['state_within_tolerance']}")
    write_json(RESULTS, meta, {"train_cifar_flags": flags, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

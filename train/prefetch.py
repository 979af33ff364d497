"""``prefetch``: an iterator run in a background thread, its items placed on devices ahead of use."""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

import jax


def prefetch(
    iterator: Iterator[Any], size: int = 2, sharding: jax.sharding.Sharding | None = None
) -> Iterator[Any]:
    """Run `iterator` in a background thread, keeping up to `size` items ready.

    With `sharding`, every array leaf is placed with `jax.make_array_from_process_local_data`
    (this process's rows of a batch sharded along its first axis; one process: the whole batch).
    Exceptions in the iterator are re-raised in the consumer; abandoning the generator stops the thread.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    items: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()
    done = object()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in iterator:
                if sharding is not None:
                    item = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), item)
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
            put((None, error))

    thread = threading.Thread(target=produce, daemon=True, name="prefetch")
    thread.start()
    try:
        while True:
            item, error = items.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        # Joined, not left to die as a daemon: a thread still inside XLA when the interpreter
        # exits aborts the process ("terminate called ... FATAL: exception not rethrown").
        thread.join()

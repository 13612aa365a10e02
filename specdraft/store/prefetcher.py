"""Batches read ahead on a background thread while the trainer computes (the reader's fast path):
``Prefetcher`` loads items in order into a bounded queue, pinned when CUDA is available.
"""

from __future__ import annotations

import queue
import threading

import torch


class Prefetcher:
    """``load(item)`` for each item in order, ``depth`` items ahead on a background thread.

    A bounded queue holds the loaded batches (pinned when CUDA is available, so the copy to the GPU
    is asynchronous); an exception in ``load`` is raised to the consumer at that position; ``close``
    (or leaving the ``with`` block, or exhausting it) stops and joins the thread. ``depth`` 0 loads in
    the consumer's thread.
    """

    _DONE = object()

    def __init__(self, load, items: list, depth: int = 2, pin: bool | None = None) -> None:
        self.load, self.items, self.depth = load, list(items), depth
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._position = 0
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._work, name="specdraft-prefetch", daemon=True)
            self._thread.start()

    def _produce(self, item):
        batch = self.load(item)
        return batch.pin_memory() if self.pin else batch

    def _work(self) -> None:
        for item in self.items:
            if self._stop.is_set():
                return
            try:
                result = (True, self._produce(item))
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
                result = (False, err)
            if not self._put(result) or not result[0]:
                return
        self._put((True, self._DONE))

    def _put(self, result) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(result, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self):
        if self._thread is None:  # depth 0: synchronous
            if self._position >= len(self.items):
                raise StopIteration
            self._position += 1
            return self._produce(self.items[self._position - 1])
        if self._stop.is_set():
            raise StopIteration
        ok, value = self._queue.get()
        if ok and value is self._DONE:
            self.close()
            raise StopIteration
        if not ok:
            self.close()
            raise value
        return value

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.05)  # unblock a put
                except queue.Empty:
                    pass
            self._thread.join()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

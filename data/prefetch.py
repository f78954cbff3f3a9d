"""Background prefetching, so the train step never waits for the next batch."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

_END = object()


class Prefetcher:
    """Runs an iterator in a daemon thread, ``size`` items ahead of the consumer.

    An exception raised by the iterator is re-raised by ``next()`` in the
    consumer. If the iterator has a ``state()`` method (a
    :class:`data.TokenBatcher`), :meth:`state` returns the state as of the
    last item the *consumer* received, not the producer's, which runs ahead;
    that is what a checkpoint must store.

    Use as a context manager, or call :meth:`close` to stop the thread.
    """

    def __init__(self, iterator: Iterator, size: int = 2):
        self._iterator = iterator
        self._has_state = callable(getattr(iterator, "state", None))
        self._state = iterator.state() if self._has_state else None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, size))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._iterator:
                state = self._iterator.state() if self._has_state else None
                if not self._put((item, state, None)):
                    return
        except BaseException as e:  # noqa: BLE001  handed to the consumer
            self._put((None, None, e))
            return
        self._put((_END, None, None))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item, state, error = self._queue.get()
        if error is not None:
            self._done = True
            raise error
        if item is _END:
            self._done = True
            raise StopIteration
        self._state = state
        return item

    def state(self) -> Any:
        """The wrapped iterator's state after the last consumed item (None if it has none)."""
        return self._state

    def close(self) -> None:
        """Asks the background thread to stop and waits for it up to 5 s; pending items are
        discarded. A thread still inside a slow `next()` of the wrapped iterator finishes
        that call on its own; it is a daemon, so it does not keep the process alive."""
        self._stop.set()
        self._done = True
        self._thread.join(timeout=5)  # its put gives up within 0.1 s of the stop
        # Emptied after the join: an item the thread was putting as the stop came would go
        # in after an emptying before it, and stay for as long as this object.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prefetch(iterator: Iterator, size: int = 2) -> Prefetcher:
    """Iterates ``iterator`` in a background thread with a queue of ``size`` items.

    Args:
      iterator: any iterator, e.g. a :class:`data.TokenBatcher`.
      size: how many items to prepare ahead.

    Returns:
      A :class:`Prefetcher` (an iterator; ``close()`` it when done).
    """
    return Prefetcher(iterator, size)

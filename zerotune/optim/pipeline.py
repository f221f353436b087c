"""The pipeline an NVMe store streams a step through: the chunks to update (``Feed``),
each chunk's slot (``Entry``) and the stages of its way (``StepPipeline``); see [Note:
reading ahead of backward] and [Note: overlapped step] in zero_adam.py."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

__all__ = ["IDLE", "Entry", "Feed", "StepPipeline", "UpdateThread", "gate_writes"]

IDLE = object()  # yielded by a pipeline whose open feed has nothing to do yet


class Feed:
    """The chunks ``(unit, c0, c1)`` a pipeline updates, in order. An open feed may be given
    more while its pipeline runs (the overlapped step adds each unit as backward finishes
    it); the pipeline ends when the feed is closed and empty. ``expected``: chunks likely
    to come, in the order they are likely to come, which the NVMe pipeline may read ahead
    (see [Note: reading ahead of backward])."""

    def __init__(self, items=(), closed: bool = True, expected=(), reserve: int = 2) -> None:
        self.items: deque = deque(items)
        self.closed = closed
        self.expected = list(expected)
        # Slots reading ahead leaves free for launched work (none when nothing launches
        # before the feed is closed: a clipped overlapped step).
        self.reserve = reserve
        self.todo: deque = deque()  # taken by the pipeline, waiting for a staging slot

    def promote(self, unit) -> None:
        """Update ``unit``'s chunks before the others not started yet (each unit's chunks
        keep their order): something is about to need its new values."""
        for queue in (self.todo, self.items):
            if any(item[0] is unit for item in queue):
                mine = [item for item in queue if item[0] is unit]
                rest = [item for item in queue if item[0] is not unit]
                queue.clear()
                queue.extend(mine + rest)

    @classmethod
    def of(cls, feed) -> Feed:
        return feed if isinstance(feed, Feed) else cls(feed)

    def take(self):
        return self.items.popleft() if self.items else None


class Entry:
    """A chunk in a staging slot of the NVMe pipeline: its reads, and its gradient once
    its unit is launched."""

    __slots__ = (
        "buf",
        "grad",
        "handles",
        "in_place",
        "item",
        "launched",
        "pieces",
        "state_bytes",
    )

    def __init__(self, item, buf, state_bytes, pieces, handles, in_place=False) -> None:
        self.in_place = in_place  # the master is updated in the parameter file's pages
        self.item = item
        self.buf = buf
        self.state_bytes = state_bytes
        self.pieces = pieces
        self.handles = handles
        self.grad = None
        self.launched = False


def gate_writes(unit):
    """Wait (yielding each handle not done yet) for the unit's writes in flight: gradients
    spilled to NVMe must be on disk before the step reads them back."""
    for handle in unit.pending_write_handles():
        if not handle.done():
            yield handle
    unit.wait_writes()


class UpdateThread:
    """One thread that runs the arithmetic of host updates (see [Note: host updates off the
    launching thread]); made on first use, it ends with its owner."""

    DEPTH = 2  # chunks handed to it at once: the next one is queued as one runs

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn) -> _Job:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                1, thread_name_prefix="zerotune-update", initializer=_leave_a_core
            )
        return _Job(self._pool.submit(fn))

    def run(self, feed: Feed, begin):
        """The chunks of ``feed`` as a generator over this thread: ``begin(item)`` does a
        chunk's bookkeeping here and returns ``(math, finish)``; ``math`` runs on the
        thread, ``finish`` here once it is done, chunk after chunk in order. It yields
        what it waits for (``IDLE``: more work) as a store's pipeline does."""
        in_flight: deque = deque()  # (job, finish), oldest first
        try:
            while True:
                room = len(in_flight) < self.DEPTH
                if room and (item := feed.take()) is not None:
                    yield from gate_writes(item[0])
                    math, finish = begin(item)
                    in_flight.append((self.submit(math), finish))
                    continue
                if not in_flight:
                    if feed.closed:
                        return
                    yield IDLE
                    continue
                job, finish = in_flight[0]
                if not job.done():
                    yield _Ready(job, feed if room else None)
                    if room and feed.items:
                        continue  # more work came: hand it over first
                job.wait()
                in_flight.popleft()
                finish()
        finally:
            for job, _ in in_flight:  # a failure or an abandoned step: nothing left running
                job.wait_quietly()


def _leave_a_core() -> None:
    """The update thread's kernels use one thread fewer than torch's count: the calling
    thread keeps a core to launch the accelerator's work on (this thread's own setting;
    threads that already run keep theirs)."""
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads() - 1))


class _Job:
    __slots__ = ("_future",)

    def __init__(self, future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()

    def wait_quietly(self) -> None:
        self._future.exception()


class _Ready:
    """What ``UpdateThread.run`` waits for: its oldest chunk, or (with room on the thread)
    more work in the feed."""

    __slots__ = ("feed", "job")

    def __init__(self, job: _Job, feed: Feed | None) -> None:
        self.job, self.feed = job, feed

    def done(self) -> bool:
        return self.job.done() or (self.feed is not None and bool(self.feed.items))


def _pending(handles):
    for h in handles:
        if not h.done():
            yield h


class StepPipeline:
    """One run of an :class:`NvmeStore` step over a :class:`Feed`: ``run()`` is the
    generator ``NvmeStore.pipeline`` returns, one method per stage of a chunk's way
    (absorb what the feed gives, start reads, read ahead, update, write, give up).

    [Note: reading ahead of backward]
    Up to ``layout.slots`` chunks are in staging at once: reads ahead, the one being
    updated, writes in flight. Chunks the feed has given (launched: their gradients are
    final) are read first, in order. Spare slots read ahead of launch: the chunks of
    ``feed.expected`` (the units in the order the last overlapped step launched them),
    keeping ``feed.reserve`` slots (two) for launched work. A chunk read ahead waits in its
    slot until its unit is launched, which then only adds its gradient; the master and the
    moments do not depend on the gradient, and nothing else writes them during a step. In
    a clipped overlapped step nothing launches before the feed closes, and reading ahead
    takes every slot. A wrong guess (a unit launched while reads ahead hold other units'
    chunks) gives the reads ahead up and ends reading ahead for the step; units never
    launched give theirs up at the end. Each unit's chunks are updated in order. Should
    the pipeline fail (an I/O error, an exception in ``update``), it waits for its
    transfers and gives every slot back on the way out.
    """

    def __init__(self, store, feed: Feed, update) -> None:
        self.store = store
        self.feed = feed
        self.update = update  # update(unit, c0, c1, master, moments, grad)
        self.slots = store.slots
        self.writes: deque = deque()  # (handles, buf) of updated chunks
        self.started: deque = deque()  # entries whose reads are issued, in order
        self.todo = feed.todo  # launched chunks not started yet (``Feed.promote`` reorders)
        self.ahead: dict = {}  # (unit index, c0) -> entry read ahead of its unit's launch
        self.seen: set = set()  # (unit index, c0) of chunks started or in todo
        self.planned: deque = deque(feed.expected)
        self.gated: set[int] = set()

    def used(self) -> int:
        return len(self.started) + len(self.writes)

    def gate(self, unit):
        if unit.index not in self.gated:  # its gradients must be on disk first
            yield from gate_writes(unit)
            self.gated.add(unit.index)

    def absorb(self):
        """Take what the feed has: chunks read ahead become launched, the rest wait for a
        slot. A unit launched while reads ahead hold other units' chunks (the units
        expected before it) shows the guess wrong: they are given up, and this step reads
        no more ahead."""
        while (item := self.feed.take()) is not None:
            key = (item[0].index, item[1])
            entry = self.ahead.pop(key, None)
            if entry is None:
                if any(e.item[0] is not item[0] for e in self.ahead.values()):
                    yield from self.drop_guess()
                self.todo.append(item)
                self.seen.add(key)
                continue
            yield from self.gate(item[0])
            self.store.attach_grad(entry)
            entry.launched = True

    def drop_guess(self):
        for entry in [e for e in self.started if not e.launched]:
            yield from self.give_up(entry)
        self.ahead.clear()
        self.planned.clear()

    def finish_done_writes(self) -> None:
        while self.writes and all(h.done() for h in self.writes[0][0]):
            self.store.finish_write(self.writes.popleft())

    def start_launched(self):
        while self.todo and self.used() < self.slots:
            item = self.todo.popleft()
            yield from self.gate(item[0])
            entry = self.store.start(item)
            self.store.attach_grad(entry)
            entry.launched = True
            self.started.append(entry)

    def read_ahead(self) -> None:
        feed = self.feed
        while (
            self.planned
            and not self.todo
            and not feed.closed
            and self.used() < self.slots - feed.reserve
        ):
            item = self.planned.popleft()
            key = (item[0].index, item[1])
            if key in self.seen:
                continue
            self.seen.add(key)
            entry = self.store.start(item)
            self.ahead[key] = entry
            self.started.append(entry)

    def give_up(self, entry):
        """Drop an entry read ahead: once its reads are over (its slot may not be reused
        before), out of ``started`` and back to staging. Its data is not used, so neither
        are its read errors."""
        yield from _pending(entry.handles)
        self.started.remove(entry)
        self.store.abandon([(entry.handles, entry.buf)])

    def update_and_write(self, entry):
        """Wait for the chunk's reads, update it, and queue its writes."""
        store = self.store
        (unit, c0, c1), buf = entry.item, entry.buf
        for h in entry.handles:
            if not h.done():
                yield h
            h.wait()
        in_param_file = unit.placement.master_in_param_file
        master, state = store.views(entry)
        if entry.in_place:
            store.update_in_place(self.update, unit, c0, c1, state, entry.grad)
        else:
            self.update(unit, c0, c1, master, state, entry.grad)
        entry.grad = None
        if c1 == unit.shard_numel:
            unit.accumulator.drop_held()  # its last chunk is updated
        copied_master = in_param_file and not entry.in_place
        if copied_master:
            unit.keep_private()  # a unit mapping that file must not see the change
        # The slot stays in ``started`` until its writes are queued, its transfers from
        # here on being the writes (a failure waits for them).
        hs = entry.handles = []
        for part, file, off in entry.pieces:
            hs.append(file.write(part, off))
        store.bytes_written += sum(part.numel() for part, _, _ in entry.pieces)
        if copied_master:
            unit.param_file_writes.append(hs[0])  # a gather must wait for it
        self.started.remove(entry)
        self.writes.append((hs, buf))

    def steps(self):
        feed = self.feed
        while True:
            yield from self.absorb()
            self.finish_done_writes()
            yield from self.start_launched()
            self.read_ahead()
            entry = next((e for e in self.started if e.launched), None)
            if entry is not None:
                yield from self.update_and_write(entry)
                continue
            # Nothing to update yet, or launched work waits for a slot: reads ahead leave
            # ``reserve`` for it, so writes hold the others.
            if self.writes:
                yield from _pending(self.writes[0][0])
                self.store.finish_write(self.writes.popleft())
                continue
            if self.todo:
                raise RuntimeError("optimizer pipeline: launched chunks found no slot")
            if feed.items:
                continue  # given more meanwhile
            if feed.closed:
                while self.started:  # read ahead for units that were not launched
                    yield from self.give_up(self.started[0])
                return
            yield IDLE

    def run(self):
        ended = False
        try:
            yield from self.steps()
            ended = True
        finally:
            if not ended:  # an error (or the generator dropped): give every slot back
                held = [(e.handles, e.buf) for e in self.started] + list(self.writes)
                self.store.abandon(held)

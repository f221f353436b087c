"""The units an optimizer updates during one overlapped backward, streamed through its
state store's pipeline (see [Note: overlapped step], [Note: carrying the step into the
next forward] and [Note: a clipped overlapped step] in zero_adam.py, [Note: reading ahead
of backward] in pipeline.py).

The optimizer provides ``store`` (``chunks``, ``pipeline``), ``unit_segments``,
``count_step``, ``update_chunk(unit, c0, c1, master, state, grad)``, ``launch_order``
(the units of its last overlapped step, in order), ``owns`` and, with clipping,
``norm_sq`` and ``add_unit_sum_of_squares``: ZeroAdamW and ZeroOptimizer with its state
on NVMe.
"""

from __future__ import annotations

from .pipeline import IDLE, Feed

__all__ = ["OverlappedStep"]


class OverlappedStep:
    """The units updated during one overlapped backward ([Note: overlapped step]), and
    after ``step()`` in the next forward ([Note: carrying the step into the next forward])."""

    def __init__(self, opt, carry: bool = False, clipping: bool = False) -> None:
        self.opt = opt
        self.carry = carry
        # Updates wait for ``release`` (in step(), once the global norm is known) instead of
        # starting as backward finishes each unit ([Note: a clipped overlapped step]).
        self.clipping = clipping
        self.launched: dict[int, None] = {}  # unit indices, in launch order
        self.unfinished: dict[int, object] = {}  # launched units not updated yet
        self.progress: dict[int, int] = {}  # unit index -> shard elements updated (in order)
        # unit index -> shard elements whose update has begun (their squares are summed for
        # a tracked norm by then); ahead of ``progress`` where updates run on a thread.
        self.begun: dict[int, int] = {}
        units = opt.engine.units  # a unit's index is its place in this list
        if clipping:
            # Released in the order the next forward gathers them; the first ones, up to
            # the engine's budget, keep their final gradient in memory.
            order = [u.index for u in units if opt.owns(u)]
            self.keep = opt.engine.reducer.grads_kept_for_update([units[i] for i in order])
        else:
            # Expected to launch as the last overlapped step did.
            order, self.keep = opt.launch_order, set()
        # Chunks of launched units, in launch order; expected: those likely to come, in
        # their likely order, which an NVMe store reads ahead of their launch (see [Note:
        # reading ahead of backward] in pipeline.py).
        expected = [(units[i], c0, c1) for i in order for c0, c1 in opt.store.chunks(units[i])]
        self.feed = Feed(closed=False, expected=expected, reserve=0 if clipping else 2)
        self._job = None  # the store's pipeline over the feed (one for the whole backward)
        self._waiting = None  # the I/O handle it waits for, or IDLE
        self._failed: BaseException | None = None  # what ended the pipeline early
        self.phase = "during backward"  # when it runs, for the error message
        self._refused = False  # a second backward was refused (check_second_backward)
        self.carried = False  # step() left its updates to the next forward
        # The arithmetic on the store's update thread ([Note: host updates off the launching
        # thread] in zero_adam.py).
        self.threaded: bool = opt.updates_off_thread()
        if expected:
            self._job = self._pipeline()
            self.pump()  # reads ahead start before backward does

    def _pipeline(self):
        if self.threaded:  # a ResidentStore's: the one store that takes ``begin``
            return self.opt.store.pipeline(self.feed, self._update, begin=self._begin)
        return self.opt.store.pipeline(self.feed, self._update)

    def _update(self, unit, c0, c1, *state) -> None:
        self.begun[unit.index] = c1
        self.opt.update_chunk(unit, c0, c1, *state)
        self._updated(unit, c1)

    def _begin(self, unit, c0, c1, *state):
        """``_update`` in two: the bookkeeping now, the arithmetic for the update thread,
        then ``finish`` (here again, once the arithmetic is done)."""
        math, finish = self.opt.begin_chunk(unit, c0, c1, *state)
        self.begun[unit.index] = c1

        def done() -> None:
            finish()
            self._updated(unit, c1)

        return math, done

    def _updated(self, unit, c1: int) -> None:
        self.progress[unit.index] = c1
        if c1 == unit.shard_numel:
            self.unfinished.pop(unit.index, None)
            # A carried update read gradients that zero_grad left for it: they go now.
            unit.accumulator.drop_held()
            unit.update_done()

    def launch(self, unit) -> None:
        """``unit``'s gradient shard is final: queue its update and start what can start
        (clipping: add its share of the norm, and keep its gradient for ``release``)."""
        opt = self.opt
        segs = opt.unit_segments.get(unit.index)
        if segs is None or unit.accumulator.is_zero or unit.index in self.launched:
            return
        self._take(unit)
        if self.clipping:
            opt.add_unit_sum_of_squares(opt.norm_sq, unit)
            if unit.index not in self.keep:
                unit.accumulator.spill_held()
        else:
            self._queue(unit)
        self.pump()

    def _take(self, unit) -> None:
        """``unit``'s update is this step's: its step counts are taken now."""
        self.launched[unit.index] = None
        self.unfinished[unit.index] = unit
        unit.queue_update()
        self.opt.count_step(unit)

    def _queue(self, unit) -> None:
        self.feed.items.extend((unit, c0, c1) for c0, c1 in self.opt.store.chunks(unit))
        if self._job is None:
            self._job = self._pipeline()

    def release(self, late=()) -> None:
        """Clipping, in step(): the norm is known; queue every launched unit's update, and
        those of ``late`` (units whose gradients became final only at the end of backward),
        in the order the next forward gathers them."""
        for unit in late:
            if unit.index not in self.launched:
                self._take(unit)
        for unit in sorted(self.unfinished.values(), key=lambda u: u.index):
            self._queue(unit)
        self.pump()

    def pump(self, block: bool = False) -> None:
        """Advance the queued updates until one must wait for I/O (or, with ``block``, to
        the end) or nothing is queued."""
        while self._job is not None:
            waiting = self._waiting
            if waiting is IDLE:
                if not self.feed.items and not self.feed.closed:
                    return
            elif waiting is not None and not block and not waiting.done():
                return
            self._resume()

    def _resume(self) -> None:
        """Run the pipeline to its next wait (waiting first for the handle it gave)."""
        self._check_failed()
        try:
            self._waiting = next(self._job)  # resuming waits for the last handle
        except StopIteration:
            self._job = self._waiting = None
        except BaseException as exc:
            self._job = self._waiting = None
            self._failed = exc
            if self.carried:  # past step(): say what it means for training
                self._check_failed()
            raise

    def settle(self, unit=None) -> None:
        """Run the pipeline until ``unit`` (moved to the front first) is updated, or with
        None to the end. The feed is closed by then (``close``)."""
        if unit is not None and unit.index not in self.unfinished:
            return
        self._check_failed()
        if unit is not None:
            self.feed.promote(unit)
        while self._job is not None and (unit is None or unit.index in self.unfinished):
            self._resume()

    @property
    def failed(self) -> bool:
        return self._failed is not None

    @property
    def broken(self) -> bool:
        """Its own pipeline failed, or it refused a second backward: some units may be
        updated and others not, so ``step()`` refuses instead of giving the step up."""
        return self._failed is not None or self._refused

    def abandon(self) -> None:
        """Forget the updates a failure left undone (their units' state is about to be
        replaced); the pipeline gave its staging slots back when it failed."""
        for unit in self.unfinished.values():
            unit.update_done()
            unit.accumulator.drop_held()
        self.unfinished.clear()
        self.feed.items.clear()
        self.feed.todo.clear()
        self._failed = None

    def abort(self) -> int:
        """The backward inside ``overlapped()`` raised ([Note: a backward that raises inside
        overlapped()] in zero_adam.py): updates already queued run to their end, reads ahead
        are given up, and units taken but never queued (clipping) give their step counts
        back. Returns how many units this step updated all the same."""
        self.feed.closed = True
        if self.clipping:  # nothing queued before release(): no unit was touched
            for unit in self.unfinished.values():
                self.opt.uncount_step(unit)
                unit.update_done()
                # A gradient kept for the update goes where the next micro-batch adds to
                # it (the caller may go on without zero_grad, as with torch's .grad).
                unit.accumulator.spill_held()
                unit.wait_writes()
            self.launched.clear()
            self.unfinished.clear()
        self.pump(block=True)
        return len(self.launched)

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(
                f"overlapped step: the optimizer's update pipeline failed {self.phase} "
                f"({self._failed!r}); some units of that step were not updated: resume "
                "from the last checkpoint"
            ) from self._failed

    def check_second_backward(self) -> None:
        """A backward pass starts inside this overlapped step: refused once an earlier one
        launched updates (they used its gradients alone; the new ones would be lost)."""
        if not self.launched:
            return
        exc = RuntimeError(
            "overlapped(): a second backward pass inside one overlapped() block: the first "
            "already updated the units it finished, without this one's gradients; sum the "
            "losses and call backward once, or wrap only the step's last backward"
        )
        self._refused = True  # step() refuses too: the step is incomplete
        raise exc

    def close(self) -> None:
        """Backward is over: no more units come. Refuses a step a second backward broke."""
        self.feed.closed = True
        if self._refused:
            self.carry = False
            self.pump(block=True)
            raise RuntimeError(
                "overlapped step: a second backward pass was refused; some units of this "
                "step were updated with the first pass's gradients alone and the others not "
                "at all: resume from the last checkpoint"
            )
        self._check_failed()
        self.opt.launch_order = list(self.launched)
        self.phase = "in step()"

    def finish(self) -> None:
        """Run every queued update to its end."""
        self.feed.closed = True
        self.pump(block=True)
        self._check_failed()
        if self.feed.items or self.feed.todo or self.unfinished:
            # an update lost would be silent: refuse instead
            raise RuntimeError("overlapped step: the pipeline ended with updates still queued")

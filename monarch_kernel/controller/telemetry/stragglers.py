"""Naming the straggler: one rank whose data, compute or other time stays above the
others' by a margin for several steps in a row, and whom the others wait for.

:class:`StragglerDetector` sees each step once every rank running it reported it (or
once later steps came and some rank never will), compares each rank with the median
of the others per category and keeps a streak per ``(rank, category)``:

* a rank is above in a category when its time exceeds the others' median by more
  than :attr:`Margins.absolute` *and* by more than :attr:`Margins.relative` times that
  median, and the others waited in collectives for at least :attr:`Margins.wait_share`
  of the excess (they really were held up by it);
* :attr:`Margins.steps` steps in a row above (the first step of a cell is skipped: it
  warms up) make a :class:`StragglerNotice`; as many steps in a row not above make its
  recovery notice.

Both margins together keep a loaded machine from naming anyone: scheduling noise on
a few busy cores adds milliseconds to random ranks on random steps, not tens of
milliseconds to the same rank step after step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from monarch_kernel.wire.steps import StepRecord

#: The categories a straggler is named for (communication is the others' symptom).
BLAMED = ("data", "compute", "other")
#: Meshes of at least this many ranks compare a rank with the median of all (itself
#: included) instead of the others' (one median per step instead of three).
EXACT_BELOW = 16
#: How a category reads in the notice.
LABELS = {"data": "data loading", "compute": "compute", "other": "other work"}


@dataclass(frozen=True)
class Margins:
    """How far above the others a rank must be, and for how long."""

    absolute: float = 0.015
    relative: float = 1.0
    wait_share: float = 0.5
    steps: int = 4
    #: Steps at the start of each cell not judged (warm-up).
    skip: int = 1


@dataclass(frozen=True)
class StragglerNotice:
    """A rank became the straggler (``recovered`` False) or stopped being one."""

    rank: int
    host: str
    category: str
    #: Its time in ``category`` per step, the others' median (s), over the streak.
    value: float
    median: float
    #: The others' median time blocked in collectives per step (s), and in which op.
    wait: float
    op: str
    #: The step (of its cell) at which it was decided.
    step: int
    recovered: bool = False

    def line(self) -> str:
        """The line shown under the running cell."""
        label = LABELS.get(self.category, self.category)
        what = f"{label} {_ms(self.value)} ms/step vs {_ms(self.median)} ms median"
        if self.recovered:
            return f"rank {self.rank} ({self.host}) is no longer the straggler: {what}"
        op = self.op or "collectives"
        return (
            f"rank {self.rank} ({self.host}) is the straggler: {what}; "
            f"ranks wait {_ms(self.wait)} ms/step in {op}"
        )


def _ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.0f}" if ms >= 1 else f"{ms:.1f}"


@dataclass
class _Streak:
    rank: int
    category: str
    values: list[float]
    medians: list[float]
    waits: list[float]
    ops: Counter[str]


class StragglerDetector:
    """Judges complete steps (see the module docstring); not thread-safe (one
    caller: the controller's receiving thread)."""

    def __init__(self, host_of: Callable[[int], str], margins: Margins | None = None):
        self.margins = margins or Margins()
        self._host_of = host_of
        self._streak: _Streak | None = None
        #: The rank named now (None: nobody), its category, and steps it was not above.
        self.current: StragglerNotice | None = None
        self._clean = 0

    def judge(self, step: int, records: dict[int, StepRecord]) -> StragglerNotice | None:
        """Step ``step`` of a cell, every rank's record: a notice if one is due."""
        m = self.margins
        if step <= m.skip or len(records) < 2:
            return None
        ranks = list(records)
        rows = [records[r] for r in ranks]
        table = np.array([[s.data, s.compute, s.other, s.comm] for s in rows])
        found = self._above(ranks, table, records)
        if found is None:
            self._streak = None
            return self._maybe_recovered(step, records)
        rank, category, value, median, wait, op = found
        s = self._streak
        if s is None or s.rank != rank or s.category != category:
            s = self._streak = _Streak(rank, category, [], [], [], Counter())
        s.values.append(value)
        s.medians.append(median)
        s.waits.append(wait)
        if op:
            s.ops[op] += 1
        current = self.current
        if current is not None and current.rank == rank:
            self._clean = 0
            return None
        if current is not None:  # another rank is above: the named one is no longer
            self._clean += 1
            if self._clean >= m.steps:
                return self._recovered(step, records)
            return None
        if len(s.values) < m.steps:
            return None
        n = m.steps
        notice = StragglerNotice(
            rank,
            self._host_of(rank),
            category,
            float(np.mean(s.values[-n:])),
            float(np.mean(s.medians[-n:])),
            float(np.mean(s.waits[-n:])),
            s.ops.most_common(1)[0][0] if s.ops else "",
            step,
        )
        self.current = notice
        self._clean = 0
        return notice

    def _above(
        self, ranks: list[int], table: np.ndarray, records: dict[int, StepRecord]
    ) -> tuple[int, str, float, float, float, str] | None:
        """The rank and category most above the others this step, if any is."""
        m = self.margins
        median = np.median(table, axis=0)
        excess = table[:, :3] - median[:3]
        i, c = np.unravel_index(int(np.argmax(excess)), excess.shape)
        if excess[i, c] <= m.absolute:
            return None
        value = float(table[i, c])
        if len(ranks) >= EXACT_BELOW:  # one rank moves the median of many by next to nothing
            med, wait = float(median[c]), float(median[3])
        else:
            others = np.delete(table, i, axis=0)
            med = float(np.median(others[:, c]))
            wait = float(np.median(others[:, 3]))
        over = value - med
        if over <= m.absolute or over <= m.relative * med or wait < m.wait_share * over:
            return None
        rank = ranks[int(i)]
        ops = Counter(records[r].wait_op for r in ranks if r != rank and records[r].wait_op)
        op = ops.most_common(1)[0][0] if ops else ""
        return rank, BLAMED[int(c)], value, med, wait, op

    def _maybe_recovered(self, step: int, records: dict[int, StepRecord]) -> StragglerNotice | None:
        if self.current is None:
            return None
        self._clean += 1
        if self._clean < self.margins.steps:
            return None
        return self._recovered(step, records)

    def _recovered(self, step: int, records: dict[int, StepRecord]) -> StragglerNotice:
        """The named rank is no longer above: its time now and the others' median."""
        current = self.current
        assert current is not None
        self.current = None
        self._clean = 0
        mine = records.get(current.rank)
        others = [r.category(current.category) for k, r in records.items() if k != current.rank]
        comm = [r.comm for k, r in records.items() if k != current.rank]
        return StragglerNotice(
            current.rank,
            current.host,
            current.category,
            mine.category(current.category) if mine is not None else 0.0,
            float(np.median(others)) if others else 0.0,
            float(np.median(comm)) if comm else 0.0,
            current.op,
            step,
            recovered=True,
        )

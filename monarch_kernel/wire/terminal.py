"""What a rank's output text means on a screen: lines, and lines redrawn in place.

Progress bars (tqdm, Lightning's bars, Rich's ``Progress``, ``print(..., end="\\r")``)
redraw their line with ``\\r``, move the cursor up to redraw the lines of nested bars
(``ESC[A``), clear lines (``ESC[2K``) and hide the cursor (``ESC[?25l``). A notebook
cannot honour most of that, so each stream of each rank goes through a
:class:`Terminal`: a small screen that applies those controls and hands back *committed*
rows (final: they can no longer change) while keeping *live* rows (a bar being redrawn,
a line without its newline yet). Colours (SGR, ``ESC[...m``) stay in the text: Jupyter
renders them; every other control sequence is dropped.

``\\r`` follows the notebooks' rule (JupyterLab, the classic notebook): what comes after
it replaces the line, rather than overwriting it character by character.

Used by the kernel (rank output under a cell: bars update in place), the controller (the
per-rank log files keep each line's final state, not every frame) and ranks (their own
log file). Plain output (no ``\\r``, no escapes) takes a fast path: a split on newlines.
"""

from __future__ import annotations

import re

#: A control sequence: CSI (``ESC [ params final``), OSC (``ESC ] ... BEL|ST``), another
#: two-character escape, or a C0 control other than tab and newline.
_TOKEN = re.compile(
    r"\x1b\[([0-?]*)[ -/]*([@-~])"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"
    r"|\x1b[ -Z\\-~]"
    r"|[\x00-\x08\x0b\x0c\x0e-\x1a\x1c-\x1f\x7f]"
)
#: An escape sequence cut off at the end of a chunk (its rest comes with the next one).
_CUT = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*)?$")
#: Characters that make text need more than a split on newlines.
_SPECIAL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
#: A row longer than this is committed as it stands (a flood without newlines).
MAX_ROW = 1 << 20


class Row:
    """One line of a :class:`Terminal`'s screen."""

    __slots__ = ("id", "text", "framed", "returned", "shown", "done")

    def __init__(self, row_id: int, text: str = ""):
        self.id = row_id
        self.text = text
        #: Redrawn in place at least once (a bar's line).
        self.framed = False
        #: The cursor went back to its start after its text (``print(..., end="\r")``):
        #: a frame that its next one replaces, not a line still being written.
        self.returned = False
        #: The owner showed it while it was live (the kernel's bar block).
        self.shown = False
        #: Committed: its text no longer changes.
        self.done = False

    def __repr__(self) -> str:
        return f"Row({self.id}, {self.text!r})"


def strip_controls(text: str) -> str:
    """``text`` without control sequences or SGR colours, and with ``\\r`` applied to
    each line (for one-line summaries: death reports, the dashboard's tiles)."""
    if "\r" in text:
        text = "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))
    if "\x1b" in text or _SPECIAL.search(text.replace("\n", "").replace("\t", "")):
        text = _TOKEN.sub("", text)
    return text


class Terminal:
    """The screen of one stream of one rank (not thread-safe: one feeder at a time).

    :meth:`feed` returns the texts of the rows committed by that text, in order; rows
    that were :attr:`Row.shown` while live are put on :attr:`settled` instead (their
    owner shows their final state where it showed them). :meth:`live` gives the rows
    that may still change; :meth:`close` commits everything.
    """

    __slots__ = (
        "_rows",
        "_cur",
        "_fresh",
        "_cr",
        "_carry",
        "_max_up",
        "_since_up",
        "_ids",
        "settled",
    )

    def __init__(self) -> None:
        self._rows: list[Row] = []  # rows that may still change; the cursor is in them
        # The cursor's row: an index in _rows (== len(_rows): a new row below them; < 0:
        # a row above them, committed already: a bar drawn below the cursor's line, as
        # tqdm's position=1 draws, moves up past the top of the live rows).
        self._cur = 0
        self._fresh = False  # the next write replaces the cursor row's text
        self._cr = False  # ... because of a \r (the row is being redrawn)
        self._carry = ""  # an escape sequence cut off at the end of the last chunk
        self._max_up = 0  # how far up the cursor went (rows kept live above the cursor)
        self._since_up = 0  # newlines since the cursor last went up
        self._ids = 0
        #: Rows committed that had been shown while live (see the class doc).
        self.settled: list[Row] = []

    @property
    def pending(self) -> bool:
        """Whether some live row has text (a bar, a line without its newline)."""
        return any(row.text for row in self._rows)

    def live(self) -> list[Row]:
        """The rows to show as live, top to bottom: bars (rows redrawn in place) and the
        line the cursor is on (text without its newline yet). Whole lines kept live
        below a bar (in case a nested bar moves back up) are not among them: they are
        committed as lines."""
        cur = self._cur
        return [r for i, r in enumerate(self._rows) if r.text and (r.framed or i == cur)]

    def _new_row(self) -> Row:
        self._ids += 1
        return Row(self._ids)

    def feed(self, text: str) -> list[str]:
        """Apply ``text``; the texts of the rows it committed."""
        if not text:
            return []
        rows = self._rows
        if (
            not self._max_up
            and not self._carry
            and not self._cur
            and len(rows) <= 1
            and "\r" not in text
            and "\x1b" not in text
            and not _SPECIAL.search(text)
        ):
            return self._feed_plain(text)
        return self._feed_controls(text)

    def _feed_plain(self, text: str) -> list[str]:
        """Text without controls, the cursor on the last row: split on newlines."""
        parts = text.split("\n")
        rows = self._rows
        first = parts[0]
        if first or len(parts) > 1:
            if rows:
                row = rows[0]
                if self._fresh:
                    if first:
                        row.text = first
                        row.returned = False
                        self._fresh = False
                        row.framed = row.framed or self._cr
                        self._cr = False
                else:
                    row.text += first
            else:
                row = self._new_row()
                row.text = first
                rows.append(row)
                self._cur = 0
        if len(parts) == 1:
            if len(rows[0].text) > MAX_ROW:
                return self._commit(1, [])
            return []
        out: list[str] = []
        row = rows[0]
        if row.framed and len(parts) == 2 and not parts[1]:
            # A bar's last frame and its newline: keep the row live until the next line
            # (a nested bar may move back up to it), as _newline does.
            self._cur = 1
            self._fresh = False
            self._cr = False
            self._since_up = 1
            return out
        rows.clear()
        self._fresh = False
        self._cr = False
        row.done = True
        if row.shown:
            self.settled.append(row)
        else:
            out.append(row.text)
        out.extend(parts[1:-1])
        last = parts[-1]
        if last:
            new = self._new_row()
            new.text = last
            rows.append(new)
        self._cur = 0
        self._since_up = 0
        return out

    def _commit(self, n: int, out: list[str]) -> list[str]:
        """Commit the first ``n`` rows."""
        rows = self._rows
        for row in rows[:n]:
            row.done = True
            if row.shown:
                self.settled.append(row)
            else:
                out.append(row.text)
        del rows[:n]
        self._cur = max(0, self._cur - n)
        return out

    def _write(self, s: str) -> None:
        rows = self._rows
        if self._cur < 0:  # onto a committed row: its text is final, write on a new one
            rows.insert(0, self._new_row())
            self._cur = 0
        elif self._cur >= len(rows):
            rows.append(self._new_row())
            self._cur = len(rows) - 1
        row = rows[self._cur]
        row.returned = False
        if self._fresh:
            row.text = s
            self._fresh = False
            if self._cr:
                row.framed = True
                self._cr = False
        else:
            row.text += s

    def _newline(self, out: list[str]) -> None:
        rows = self._rows
        if self._cur >= len(rows):
            rows.append(self._new_row())
        self._cur += 1
        # onto a row already there: overwrite it
        self._fresh = 0 <= self._cur < len(rows)
        self._cr = False
        self._since_up += 1
        if self._since_up > self._max_up:
            self._max_up = 0
        keep = self._max_up
        # A bar's row (redrawn in place) stays live while the cursor is up to two rows
        # below it: a nested bar (tqdm's position=1) goes down past it and comes back up.
        for back in (1, 2):
            i = self._cur - back
            if i >= 0 and rows[i].framed and back > keep:
                keep = back
        if self._cur - keep > 0:
            self._commit(self._cur - keep, out)

    def _feed_controls(self, text: str) -> list[str]:
        if self._carry:
            text = self._carry + text
            self._carry = ""
        cut = _CUT.search(text, max(0, len(text) - 256)) if "\x1b" in text else None
        if cut is not None:
            self._carry = text[cut.start() :]
            text = text[: cut.start()]
        out: list[str] = []
        pos = 0
        for m in _TOKEN.finditer(text):
            if m.start() > pos:
                self._plain_run(text[pos : m.start()], out)
            pos = m.end()
            self._control(m, out)
        if pos < len(text):
            self._plain_run(text[pos:], out)
        return out

    def _plain_run(self, s: str, out: list[str]) -> None:
        """Text with newlines and ``\\r`` but no escape sequences."""
        first = True
        for line in s.split("\n"):
            if not first:
                self._newline(out)
            first = False
            # Each \r sends the cursor back to the row's start: what follows replaces
            # the row (which is then framed: redrawn in place); text before it is
            # written first (``print(..., end="\r")`` puts each frame before its \r).
            for k, part in enumerate(line.split("\r")):
                if k:
                    self._carriage_return()
                if part:
                    self._write(part)
                    if len(self._rows[self._cur].text) > MAX_ROW:
                        self._newline(out)

    def _carriage_return(self) -> None:
        self._fresh = True
        self._cr = True
        rows = self._rows
        if 0 <= self._cur < len(rows) and rows[self._cur].text:
            rows[self._cur].returned = True

    def _control(self, m: re.Match[str], out: list[str]) -> None:
        token = m.group(0)
        if token == "\b":
            rows = self._rows
            if 0 <= self._cur < len(rows) and rows[self._cur].text and not self._fresh:
                rows[self._cur].text = rows[self._cur].text[:-1]
            return
        final = m.group(2)
        if final is None:
            return  # OSC, other escapes, C0 controls: dropped
        params = m.group(1) or ""
        if final == "m":  # colours: kept (notebooks render them)
            self._write(token)
            return
        if params.startswith("?") or not all(p.isdigit() for p in params.split(";") if p):
            return  # private modes (cursor hide/show, ...): dropped
        n = int(params.split(";")[0] or 1) if final in "ABEF" else 0
        rows = self._rows
        if final in "AF":  # cursor up (F: and to the line's start); above the live
            # rows, the cursor is on a committed row (see _cur)
            target = self._cur - n
            self._max_up = max(self._max_up, n + (1 if final == "F" else 0))
            self._since_up = 0
            self._cur = target
            self._fresh = final == "F"
            if 0 <= self._cur < len(rows):
                rows[self._cur].framed = True
        elif final in "BE":  # cursor down
            for _ in range(n):
                if self._cur + 1 >= len(rows):
                    self._newline(out)
                else:
                    self._cur += 1
            self._fresh = final == "E" or self._fresh
        elif final == "K":  # erase in line
            if 0 <= self._cur < len(rows) and (params in ("2", "1") or self._fresh):
                rows[self._cur].text = ""  # (erasing to the end: we write at the end)
                rows[self._cur].framed = True
        elif final == "J":  # erase in display: rows below the cursor (and its own)
            if params in ("", "0"):
                for row in rows[max(0, self._cur + 1) :]:
                    row.text = ""
                if 0 <= self._cur < len(rows) and self._fresh:
                    rows[self._cur].text = ""
        elif final == "G" and (params or "1") == "1":  # to column 1: like \r
            self._carriage_return()
        # anything else (cursor right/left, scrolling regions, ...): dropped

    def close(self) -> list[str]:
        """Commit every row (the output ends): the texts of those not shown."""
        if self._carry:
            self._carry = ""
        rows = self._rows
        while rows and not rows[-1].text.strip():
            rows.pop()
        out = self._commit(len(rows), [])
        self._cur = 0
        self._fresh = False
        self._cr = False
        self._max_up = 0
        return out

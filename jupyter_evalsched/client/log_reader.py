""":class:`LogReader`: what is new in a run's log at each read, fetched from where the last read
ended (``GET /evalsched/runs/{id}/logs?offset=N``), not the whole log again."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .rest_client import EvalSchedClient

# Parts of a log read by one LogReader.read() that is not the last: the follower's tick returns
# (to see the run's events) even under a run that writes faster than it reads.
PARTS_PER_READ = 4
# Bytes before its offset that each read asks for again and compares with those it had: a log
# rewritten in place (reopened with "w": the same inode, its times changed as by any append) and
# grown past the offset between two reads has the size of one that grew, and only its bytes tell.
OVERLAP_BYTES = 256


@dataclass(frozen=True)
class LogPart:
    """Bytes of a log as the logs route answers them: ``data`` from some offset, ``end`` the
    offset just past it, ``size`` the log's size when it was read (``end`` and ``size`` None
    from a server that does not say them: its answer is the log from its start)."""

    data: bytes
    end: int | None
    size: int | None


class LogReader:
    """Reads what is new in a run's ``stdout``/``stderr`` at each :meth:`read`, as text.

    Works in bytes: the first read asks for the log's last 8 MiB (all of a shorter one; its last
    ``tail`` lines when given), each later one for the bytes past the last, and decodes them
    with an incremental UTF-8 decoder, so that a character split between two reads comes out
    whole. A log shorter than what was read (rewritten or truncated), or one whose last
    ``OVERLAP_BYTES`` bytes before the offset are no longer those read (rewritten and grown past
    it), is read again from its start, after ``on_rewritten()``.

    A server, or a server relaying to its host's primary, from before ``?offset=`` answers
    without the offset headers: from then on the reader is in legacy mode (:attr:`legacy`), for
    good. It asks for the log as such (the last 8 MiB, decoded by such a server with
    ``replace``) and gives out the characters past those it gave, as ``logs -f`` did then.

    >>> reader = LogReader(client, run_id)
    >>> print(reader.read(), end="")   # everything so far; later calls, what came since
    """

    def __init__(
        self,
        client: EvalSchedClient,
        run_id: str,
        stream: str = "stdout",
        tail: int | None = None,
        on_rewritten: Callable[[], None] | None = None,
    ):
        self.client = client
        self.run_id = run_id
        self.stream = stream
        self.tail = tail
        self.on_rewritten = on_rewritten
        self.offset: int | None = None  # where the next read starts; None before the first
        self.legacy = False  # the server does not say where its answers end
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._origin = 0  # the byte the decoder started at
        self._given = 0  # characters the decoder gave out since
        self._chars: int | None = 0  # legacy: the characters of the server's answer given out (None: to place)
        self._pending = ""
        self._overlap = b""  # the log's bytes just before ``offset``, as read (at most OVERLAP_BYTES)

    def read(self, final: bool = False) -> str:
        """The text written since the last read. ``final``: the log is complete (the run
        ended): read to its end, and give out a character left incomplete there."""
        # What was read before a read that failed (the server went away) comes with the next.
        out = [self._pending]
        self._pending = ""
        try:
            answer = None if self.legacy else self._read_parts(out, final)
            if self.legacy:
                self._read_whole(out, final, answer)
        except BaseException:
            self._pending = "".join(out)
            raise
        return "".join(out)

    def _read_parts(self, out: list[str], final: bool) -> bytes | None:
        """Reads from offsets into ``out``. A server that does not say where its answer ends
        turns the reader to legacy mode: the answer, when it is the whole log (as such a server
        answers a first read without a tail), is returned for that mode to read."""
        parts = 0
        while True:
            first = self.offset is None
            sent = b"" if first else self._overlap  # asked for again, before the offset
            if self.offset is None:  # (no offset: a server from before offsets answers this request alike)
                part = self.client.log_part(self.run_id, self.stream, tail=self.tail)
            else:
                part = self.client.log_part(self.run_id, self.stream, offset=self.offset - len(sent))
            if part.end is None or part.size is None:
                self.legacy = True
                # Past the first read, the answer may be a part from an offset (an older server
                # relaying to a newer primary) or the whole log: where to go on is asked again.
                self._chars = 0 if first else None
                return part.data if first and self.tail is None else None
            if self.offset is not None and (part.size < self.offset or not part.data.startswith(sent)):
                self.offset = 0  # rewritten: all of it again, from a fresh decoder
                self._overlap = b""
                self.tail = None
                self._decoder.reset()
                self._origin = self._given = 0
                if self.on_rewritten is not None:
                    self.on_rewritten()
                continue
            self._overlap = part.data[-OVERLAP_BYTES:]
            data = part.data[len(sent) :]
            if first:
                self._origin = part.end - len(data)
                if self._origin > 0 and self.tail is None:  # the last 8 MiB: from a character's start
                    lead = next((i for i, b in enumerate(data[:4]) if not 0x80 <= b < 0xC0), min(4, len(data)))
                    data, self._origin = data[lead:], self._origin + lead
            self._give(out, self._decoder.decode(data))
            self.offset = part.end
            parts += 1
            if not data or part.end >= part.size or (not final and parts >= PARTS_PER_READ):
                break
        if final:
            self._give(out, self._decoder.decode(b"", final=True))
        return None

    def _give(self, out: list[str], text: str) -> None:
        out.append(text)
        self._given += len(text)

    def _read_whole(self, out: list[str], final: bool, answer: bytes | None) -> None:
        """Legacy mode: the characters of the server's answer (the whole log, or its last 8 MiB)
        past those given out."""
        data = answer if answer is not None else self.client.log_part(self.run_id, self.stream).data
        text = data.decode("utf-8", "replace")
        if self._chars is None:  # from offsets until now: where the bytes given out end, in characters
            self._chars = len(data[: self._origin].decode("utf-8", "replace")) + self._given
        if not final and text.endswith("\ufffd"):
            text = text[:-1]  # maybe a character half written (such a server decodes it so): whole next time
        if len(text) < self._chars:
            self._chars = 0  # rewritten: all of it again
            self.tail = None
            if self.on_rewritten is not None:
                self.on_rewritten()
        new = text[self._chars :]
        if self.tail is not None:
            new = "".join(new.splitlines(keepends=True)[-self.tail :]) if self.tail > 0 else ""
            self.tail = None
        self._chars = len(text)
        out.append(new)

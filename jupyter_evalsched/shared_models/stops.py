"""A generation's stop strings, looked for as its text grows, in time linear in the text.

After every token the model host asks two things of the text so far: whether a stop string now
ends in it (the generation is done), and, for a stream, how many characters at its end could be
the start of one (they are held back until they are final). Asked afresh each token, comparing
each stop string's prefixes with the text's end, the second cost the square of a stop string's
length per token, on the batcher thread that every caller shares. Here each stop string is a
Knuth-Morris-Pratt matcher that reads each character of the text once: its state after the text
is the longest end of the text that starts the stop string, which is both answers at once.
"""

from __future__ import annotations


class StopStrings:
    """The stop strings of one generation, and how far the text fed so far matches each."""

    def __init__(self, stops: list[str]):
        self._stops = [stop for stop in dict.fromkeys(stops) if stop]
        self._borders = [_borders(stop) for stop in self._stops]
        self._matched = [0] * len(self._stops)

    @property
    def held(self) -> int:
        """How many characters at the end of the text fed so far could be the start of a stop
        string (never a whole one: a whole one ends the generation)."""
        return max(self._matched, default=0)

    def feed(self, text: str) -> bool:
        """Add text that is final (a token's settled piece); whether a stop string ends in it."""
        found = False
        for index, stop in enumerate(self._stops):
            self._matched[index], ended = _run(stop, self._borders[index], self._matched[index], text)
            found = found or ended
        return found

    def ends_in(self, text: str) -> bool:
        """Whether a stop string ends in ``text`` read after the text fed so far, which it does
        not add (the text of a token that ends inside a character, which may still change)."""
        return any(
            _run(stop, borders, matched, text)[1]
            for stop, borders, matched in zip(self._stops, self._borders, self._matched, strict=True)
        )


def _borders(stop: str) -> list[int]:
    """KMP's failure function: ``[k]`` is the length of the longest proper prefix of
    ``stop[:k + 1]`` that is also its suffix."""
    borders = [0] * len(stop)
    length = 0
    for k in range(1, len(stop)):
        while length and stop[k] != stop[length]:
            length = borders[length - 1]
        if stop[k] == stop[length]:
            length += 1
        borders[k] = length
    return borders


def _run(stop: str, borders: list[int], matched: int, text: str) -> tuple[int, bool]:
    """The matcher's state (characters of ``stop`` matched at the end) after ``text`` read from
    state ``matched``, and whether ``stop`` ended in ``text``. Amortized linear: each character
    raises the state by one at most, and each step back along ``borders`` lowers it."""
    ended = False
    first, size = stop[0], len(stop)
    position, end = 0, len(text)
    while position < end:
        if matched == 0:  # nothing under way: the next start, found at C speed
            position = text.find(first, position)
            if position < 0:
                return 0, ended
            matched, position = 1, position + 1
        else:
            char = text[position]
            while matched and stop[matched] != char:
                matched = borders[matched - 1]
            if stop[matched] == char:
                matched += 1
            position += 1
        if matched == size:
            ended, matched = True, borders[size - 1]
    return matched, ended

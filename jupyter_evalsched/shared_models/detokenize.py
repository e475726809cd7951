"""The text of a token sequence, decoded one token at a time, in time linear in its length.

A generation's text is wanted piece by piece: a stream sends each token's text as it comes, each
token's ``text_offset`` says where its text starts, and stop strings are looked for after every
token. Decoding the whole sequence for each of these costs time quadratic in its length (an
8,000-token answer took 13 s of the batcher thread that every caller shares).

``IncrementalText`` decodes each new token in a short window instead: the tokens from the one
before the last settled run, where the text decoded so far ended on a whole character. The
window's text less the text of its settled part is what the new token adds. Decoding from a
settled token rather than from the start reads the same for byte-level BPE (GPT-2's, where a
token's bytes are its own) and for SentencePiece (Llama's, where the first token of a decode
loses its leading space: both decodes of a window start at the same token, so both lose it).
A token that ends inside a character (its text ends in U+FFFD) adds nothing until the
character is complete; the pieces always add up to the text decoded so far.
"""

from __future__ import annotations

import os
from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


class IncrementalText:
    """The pieces of a token sequence's text, one per token, as the tokens are added.

    ``decode(ids)`` is the tokenizer's decode with its options bound. (Stop strings are looked
    for in the pieces by ``stops.StopStrings``.)
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self.pieces: list[str] = []  # one per token, adding up to the settled text
        self.length = 0  # characters in the pieces
        self.pending = ""  # the text of the tokens after the last settled one; may end inside a character
        self._start = 0  # the window: ids[_start:], of which ids[_start:_settled] is settled
        self._settled = 0
        self._settled_text = ""  # decode(ids[_start:_settled])

    @property
    def reach(self) -> int:
        """Characters up to the end of the newest token, less a character it ends inside of:
        where the next token's text starts (its ``text_offset``)."""
        return self.length + len(self.pending.rstrip(REPLACEMENT))

    def add(self, token: int) -> str:
        """Add a token; its piece of the text (empty while it ends inside a character)."""
        self.ids.append(token)
        window = self._decode(self.ids[self._start :])
        if window.endswith(REPLACEMENT):
            piece = ""
            same = len(os.path.commonprefix([window, self._settled_text]))
            self.pending = window[same:]
        else:
            # A decoder that rewrites text across tokens (clean-up of spaces before punctuation)
            # can change settled characters, which were sent already: only what follows the
            # part both decodes share is new.
            piece = window[len(os.path.commonprefix([window, self._settled_text])) :]
            self.pending = ""
            # The next window starts at this run's first token: one settled run of context.
            # A run with no text (skipped special tokens, or a lone space that a decoder strips
            # at the start) is no context: the next token's own leading space would be stripped.
            run = self._decode(self.ids[self._settled :]) if self._settled else window
            if run:
                self._start, self._settled_text = self._settled, run
            else:
                self._settled_text = window
            self._settled = len(self.ids)
        self.length += len(piece)
        self.pieces.append(piece)
        return piece


def offsets(decode: Callable[[list[int]], str], ids: list[int], base: int = 0) -> list[int]:
    """Where each token's text starts when ``ids`` are decoded one after another after ``base``
    characters: a token after one that ends inside a character starts where that character does."""
    text = IncrementalText(decode)
    starts = []
    for token in ids:
        starts.append(base + text.reach)
        text.add(token)
    return starts

"""Incremental detokenisation that is right for multi-byte characters and leading spaces.

Decoding token by token breaks characters split across tokens (bytes of one UTF-8 character) and
drops the spaces some tokenizers attach to the previous token. Instead decode a short window that
starts a few tokens back, and emit only what is new once it no longer ends in an incomplete
character (U+FFFD). Stop strings are searched in the full text; text that could still turn out to be
the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool, stop_strings: list[str], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = stop_strings
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0  # chars of self.text already returned as deltas
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token. Returns the stop string if the text now contains one (text is cut)."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            search_from = max(0, len(self.text) - self.holdback)
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            return self._find_stop(search_from)
        return None

    def _find_stop(self, search_from: int) -> str | None:
        best = None
        for stop in self.stop_strings:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        return stop

    def take_delta(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

"""Incremental detokenization and the batching policy (pure: no I/O, no clock).

A token id is not text. In a byte-level BPE a token stands for bytes, and a
character of three or four UTF-8 bytes is often split across two or three
tokens; the first ones alone are not text at all. An incremental
detokenizer therefore *holds* incomplete bytes and *releases* them when the
token that completes the character arrives. Its contract, tested with
hypothesis on arbitrary id sequences::

    "".join(d.feed([i]) for i in ids) + d.finish() == tokenizer.decode(ids)

Two implementations, both from the same HF tokenizer:

* :class:`HFStreamDetokenizer` -- ``tokenizers.decoders.DecodeStream``, the
  library's own streaming decoder (default);
* :class:`TableDetokenizer` -- a table of each token's raw bytes (read back
  from the byte-level vocabulary) and Python's incremental UTF-8 decoder.

``released`` counts tokens whose bytes are all out as text: the host stamps
a token "detokenized" when it is released, not when it is fed.
"""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Detokenizer(Protocol):
    """What the host (or a client) needs from an incremental detokenizer."""

    released: int  # tokens whose text is entirely out

    def feed(self, ids: Sequence[int]) -> str:
        """Take more token ids; return the text they completed (maybe "")."""

    def finish(self) -> str:
        """End of stream: return whatever is held (invalid bytes become U+FFFD)."""


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: the printable character standing for each byte.

    Bytes that are printable and not blank stand for themselves; the others
    (controls, space, NBSP, soft hyphen, ...) are given the code points from
    256 upward, in byte order. Inverse mapping: character -> byte.
    """
    direct = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars: dict[str, int] = {chr(b): b for b in direct}
    extra = 0
    for b in range(256):
        if b not in direct:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def byte_table(tokenizer: Any, skip_special_tokens: bool = True) -> list[bytes]:
    """The raw bytes of every token id (special tokens: empty when skipped)."""
    alphabet = _byte_level_alphabet()
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values()
                if getattr(t, "special", False)}
    table: list[bytes] = []
    for i in range(tokenizer.get_vocab_size()):
        piece = tokenizer.id_to_token(i)
        if piece is None:
            table.append(b"")
        elif piece in specials:
            table.append(b"" if skip_special_tokens else piece.encode("utf-8"))
        else:
            table.append(bytes(alphabet[c] for c in piece))
    return table


class TableDetokenizer:
    """Token bytes from a table, text from Python's incremental UTF-8 decoder."""

    def __init__(self, table: Sequence[bytes]) -> None:
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._ends: deque[int] = deque()  # cumulative byte end of each unreleased token
        self._bytes = 0
        self.released = 0

    def feed(self, ids: Sequence[int]) -> str:
        table = self._table
        try:
            if len(ids) == 1:
                data = table[ids[0]]
                self._bytes += len(data)
                self._ends.append(self._bytes)
            else:
                parts = [table[i] for i in ids]
                for p in parts:
                    self._bytes += len(p)
                    self._ends.append(self._bytes)
                data = b"".join(parts)
        except IndexError:
            raise ValueError(f"token id out of the vocabulary (size {len(table)})") from None
        text = self._decoder.decode(data)
        out = self._bytes - len(self._decoder.getstate()[0])  # bytes turned into text
        ends = self._ends
        while ends and ends[0] <= out:
            ends.popleft()
            self.released += 1
        return text

    def finish(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self.released += len(self._ends)
        self._ends.clear()
        return text


class HFStreamDetokenizer:
    """``tokenizers.decoders.DecodeStream``, plus a final flush.

    DecodeStream holds a token while its text would end in U+FFFD and never
    flushes at the end of a stream; :meth:`finish` emits the rest of the full
    decode (``tokenizer.decode`` of every id) after what was already sent.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted: list[str] = []
        self._vocab = tokenizer.get_vocab_size()
        self.released = 0
        #: False if DecodeStream ever emitted text that is not a prefix of the full decode
        self.consistent = True

    def feed(self, ids: Sequence[int]) -> str:
        step = self._stream.step
        tok = self._tok
        out: list[str] = []
        for i in ids:
            if not 0 <= i < self._vocab:
                raise ValueError(f"token id {i} out of the vocabulary (size {self._vocab})")
            self._ids.append(i)
            piece = step(tok, i)
            if piece is not None:
                out.append(piece)
                self.released = len(self._ids)
        text = out[0] if len(out) == 1 else "".join(out)
        if text:
            self._emitted.append(text)
        return text

    def finish(self) -> str:
        full = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        sent = "".join(self._emitted)
        self.released = len(self._ids)
        if not full.startswith(sent):
            self.consistent = False
            return ""
        rest = full[len(sent):]
        if rest:
            self._emitted.append(rest)
        return rest


def make_detokenizer(kind: str, tokenizer: Any, table: Sequence[bytes] | None = None
                     ) -> Detokenizer:
    """A fresh detokenizer of ``kind`` (``hf`` or ``table``) for one sequence."""
    if kind == "hf":
        return HFStreamDetokenizer(tokenizer)
    if kind == "table":
        return TableDetokenizer(table if table is not None else byte_table(tokenizer))
    raise ValueError(f"unknown detokenizer {kind!r}; use hf or table")


def completion_index(table: Sequence[bytes], ids: Sequence[int]) -> list[int]:
    """For each token, the index of the token whose arrival completes its characters.

    A token whose bytes end mid-character is only readable once a later token
    finishes the character; this is a property of the id sequence, the same
    for every strategy, so the layer breakdown charges the wait to generation
    (see :mod:`fabric.serving.metrics`).
    """
    d = TableDetokenizer(table)
    out: list[int] = []
    for i, t in enumerate(ids):
        before = d.released
        d.feed([t])
        out.extend([i] * (d.released - before))
    out.extend([len(ids) - 1] * (len(ids) - len(out)))  # held to the end: invalid bytes
    return out


@dataclass(frozen=True)
class BatchPolicy:
    """When a sequence's pending tokens are detokenized and sent.

    ``immediate`` is ``BatchPolicy(1, 0)``; ``batched`` flushes every
    ``tokens`` tokens or when the oldest pending token is ``max_wait_ns`` old,
    and always at the end of the sequence.
    """

    tokens: int = 1
    max_wait_ns: int = 0

    @classmethod
    def of(cls, mode: str, tokens: int, wait_ms: float) -> BatchPolicy:
        """The policy of a ``--detok`` mode."""
        if mode == "immediate":
            return cls(1, 0)
        if mode == "batched":
            return cls(max(1, int(tokens)), int(wait_ms * 1e6))
        raise ValueError(f"unknown detok mode {mode!r}")

    def due(self, pending: int, oldest_ns: int, now_ns: int, last: bool = False) -> bool:
        """Flush now?"""
        if pending <= 0:
            return False
        if last or pending >= self.tokens:
            return True
        return self.max_wait_ns > 0 and now_ns - oldest_ns >= self.max_wait_ns

    def deadline(self, oldest_ns: int) -> int | None:
        """When a timer must flush a partial batch (None: never by time)."""
        return oldest_ns + self.max_wait_ns if self.tokens > 1 and self.max_wait_ns > 0 else None

"""A base for small immutable records built on hot paths.

A frozen dataclass would say the same in fewer lines, but compiled (mypyc) a
dataclass's generated ``__init__`` stays interpreted: a record made per frame or
per contribution then costs microseconds. Subclasses write ``__init__`` out and
name their fields in ``_fields``; they get equality and a readable ``repr``.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["Record"]


class Record:
    """Equal when of one type with equal fields (``_fields``); immutable by convention."""

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self._fields)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Record)
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]  # fields may be arrays or buffers

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={v!r}" for n, v in zip(self._fields, self._values(),
                                                         strict=True))
        return f"{type(self).__name__}({inner})"

"""Registry[T]: things picked by name (quant methods, sources, sinks) register here; a miss lists the known names."""
from __future__ import annotations

from typing import Callable, Generic, Iterable, TypeVar

from ktconvert.errors import UnknownNameError

T = TypeVar("T")


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, aliases: Iterable[str] = ()) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            key = _norm(name)
            if key in self._items and self._items[key] is not obj:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[key] = obj
            for alias in aliases:
                self._aliases[_norm(alias)] = key
            return obj

        return deco

    def get(self, name: str) -> T:
        key = _norm(name)
        key = self._aliases.get(key, key)
        if key not in self._items:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
                + (f" (aliases: {', '.join(sorted(self._aliases))})" if self._aliases else "")
            )
        return self._items[key]

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())

    def __contains__(self, name: str) -> bool:
        key = _norm(name)
        return self._aliases.get(key, key) in self._items

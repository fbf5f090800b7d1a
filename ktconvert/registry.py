"""Registry[T]: things picked by name (CPU methods, sources, decoders, quantizers) register here; a miss lists the
known names.

Names are looked up case-insensitively with "_" and "-" the same. ``Registry(kind, base=B)`` accepts only
subclasses of B; a name or alias already taken by another object is refused (compressed-tensors' RegistryMixin
does both).
"""
from __future__ import annotations

from typing import Callable, Generic, Iterable, TypeVar

from ktconvert.errors import UnknownNameError

T = TypeVar("T")


def _norm(name: str) -> str:
    """The lookup key of `name`; a name that is not a string (a manifest's ``method: 3``) gets a key no entry has."""
    if not isinstance(name, str):
        return f"\0{name!r}"
    return name.strip().lower().replace("_", "-")


class Registry(Generic[T]):
    def __init__(self, kind: str, base: type | None = None):
        self.kind = kind
        self.base = base
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, aliases: Iterable[str] = ()) -> Callable[[T], T]:
        """Decorator registering an object under `name` (+ `aliases`); ValueError for a name another object holds
        or an object that is not a subclass of the registry's base."""
        def deco(obj: T) -> T:
            if self.base is not None and not (isinstance(obj, type) and issubclass(obj, self.base)):
                raise ValueError(f"{self.kind} {name!r}: {obj!r} is not a subclass of {self.base.__name__}")
            key = _norm(name)
            self._claim(key, obj, name)
            self._items[key] = obj
            for alias in aliases:
                alias_key = _norm(alias)
                if alias_key != key:
                    self._claim(alias_key, obj, alias)
                    self._aliases[alias_key] = key
            return obj

        return deco

    def _claim(self, key: str, obj: T, name: str) -> None:
        owner = self._items.get(self._aliases.get(key, key))
        if owner is not None and owner is not obj:
            raise ValueError(f"{self.kind} {name!r} registered twice")

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

"""How fork modules touch upstream objects outside HookRegistry, and read its internals.

Invariant: every instance-attribute swap and class patch the fork makes is declared in
`fork_plugin.SWAPS` and made through `swap()` here, which refuses an undeclared one,
raises `UpstreamChanged` (naming the upstream attribute) when the declared target is
missing on an object of the declared class, and records what it put in place. So
`swaps_applied()` can say, for a live object, whether each declared swap is still there
(the resource report shows it next to `hooks_applied`), and the start-up check
(`check_at_start`, the last AFTER hook on each PD queue's `_init_kv_manager`) stops the
server when a declared swap was not made. `tools/fork check` resolves every SWAPS
target in upstream's source.

`upstream(obj, name)` is the accessor for upstream internals: like getattr, but a
missing attribute raises `UpstreamChanged` instead of letting a default hide an
upstream rename. getattr-with-default stays for the fork's own optional attributes.
Threads: swaps happen in the scheduler while it builds its kv manager (before the
manager's threads look the attributes up); `_APPLIED` is append-only under `_lock`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

_MISSING = object()


class UpstreamChanged(RuntimeError):
    """An upstream attribute the fork relies on is gone (renamed or removed upstream)."""


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def upstream(obj: Any, name: str) -> Any:
    """`obj.name` for an attribute upstream defines; raises UpstreamChanged if missing."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        cls = obj if isinstance(obj, type) else type(obj)
        raise UpstreamChanged(
            f"upstream attribute {_qualname(cls)}.{name} does not exist: renamed or removed "
            "in this upstream release? The fork relies on it (update the fork module that "
            "reads it, and fork_plugin.SWAPS if it is swapped)."
        )
    return value


def _swaps() -> List[Tuple[str, str, str, str]]:
    from sglang.srt.managers.fork_plugin import SWAPS

    return SWAPS


def key(target: str, ref: str) -> str:
    """How a SWAPS entry is named in `swaps_applied` (two modules may swap one target)."""
    return f"{target} <- {ref}"


def _declared(obj: Any, by: str, attr: str, kind: str) -> Optional[str]:
    """The key of the SWAPS entry for `by` swapping `attr` on `obj` (whose class is the
    declared owner), None if `obj` is of none of the declared classes; raises if
    undeclared."""
    owners = []
    for target, ref, k, _ in _swaps():
        owner, _, name = target.rpartition(".")
        if name == attr and ref.partition(":")[0] == by and k == kind:
            if _is_a(obj, owner):
                return key(target, ref)
            owners.append(owner)
    if owners:
        return None
    raise UpstreamChanged(
        f"{by} swaps {attr!r} ({kind}) but fork_plugin.SWAPS does not declare it: "
        "every swap of an upstream attribute is declared there"
    )


def _is_a(obj: Any, owner: str) -> bool:
    classes = obj.__mro__ if isinstance(obj, type) else type(obj).__mro__
    return any(_qualname(c) == owner for c in classes)


# key(target, ref) -> [(weak ref to the object swapped on, what was put there)]
_APPLIED: Dict[str, List[Tuple[Any, Any]]] = {}
_lock = threading.Lock()


def swap(obj: Any, attr: str, make: Callable[[Any], Any], *, by: str, kind: str = "instance") -> Optional[Any]:
    """Replace `obj.attr` with `make(original)`, as fork_plugin.SWAPS declares for module
    `by` (pass `__name__`). `kind` "instance" swaps on the object, "class" patches the
    class `obj`. Returns what was put in place, or None when `obj` is not of the declared
    class (another transfer backend: nothing to swap)."""
    if kind == "class" and not isinstance(obj, type):
        raise TypeError(f"a class patch of {attr!r} needs the class, got {obj!r}")
    entry = _declared(obj, by, attr, kind)
    if entry is None:
        return None
    original = upstream(obj, attr)
    new = make(original)
    if callable(new) and getattr(new, "__wrapped__", None) is None:
        try:
            new.__wrapped__ = original
        except (AttributeError, TypeError):
            pass
    setattr(obj, attr, new)
    try:
        ref = weakref.ref(obj)
    except TypeError:
        ref = lambda obj=obj: obj  # noqa: E731
    with _lock:
        _APPLIED.setdefault(entry, []).append((ref, new))
    return new


def _in_place(obj: Any, attr: str, new: Any) -> bool:
    """Whether `new` is obj.attr or wrapped by it (later swaps wrap earlier ones)."""
    value = getattr(obj, attr, _MISSING)
    for _ in range(32):
        if value is new:
            return True
        value = getattr(value, "__wrapped__", _MISSING)
        if value is _MISSING:
            return False
    return False


def applied_on(obj: Any, target: str, ref: str) -> bool:
    """Whether the SWAPS entry (target, ref) was made on `obj` (or its class) and is
    still there."""
    attr = target.rpartition(".")[2]
    with _lock:
        records = list(_APPLIED.get(key(target, ref), ()))
    for ref, new in records:
        o = ref()
        if o is not None and (o is obj or (isinstance(o, type) and isinstance(obj, o))) and _in_place(o, attr, new):
            return True
    return False


def swaps_applied(obj: Any, role: Optional[str] = None) -> Dict[str, bool]:
    """"target <- ref" -> applied, for each SWAPS entry that applies to `obj` (its class
    is the declared owner) in `role`; {} for an object none applies to (fake backend)."""
    if obj is None:
        return {}
    out = {}
    for target, ref, _, r in _swaps():
        owner = target.rpartition(".")[0]
        if (role is None or r in (role, "both")) and _is_a(obj, owner):
            out[key(target, ref)] = applied_on(obj, target, ref)
    return out


def check_at_start(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `PrefillBootstrapQueue/DecodePreallocQueue._init_kv_manager` (the last one
    registered): every swap SWAPS declares for this manager is in place, or the
    scheduler stops here naming the ones that are not."""
    role = "prefill" if type(queue).__name__.startswith("Prefill") else "decode"
    missing = [t for t, ok in swaps_applied(mgr, role).items() if not ok]
    if missing:
        raise UpstreamChanged(
            f"fork swaps declared in fork_plugin.SWAPS were not made on this {role} kv "
            f"manager ({_qualname(type(mgr))}): {', '.join(missing)}"
        )
    return None

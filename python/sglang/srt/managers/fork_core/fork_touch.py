"""How fork modules touch upstream outside HookRegistry (docs/layout.md "Ways the fork touches upstream"):
`swap()` swaps an upstream attribute as `fork_plugin.SWAPS` declares (scheduler thread, while it builds its kv
manager; checked by `check_at_start`); `upstream(obj, name)` reads an upstream internal, failing on a rename;
`upstream_on(obj, name, owner)` reads one only some classes have (a transfer backend's), failing on a rename there."""

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
            f"upstream attribute {_qualname(cls)}.{name} does not exist: renamed or removed in this upstream "
            "release? The fork relies on it (update the fork module that reads it, and fork_plugin.SWAPS if swapped)."
        )
    return value


# Upstream classes whose attributes only some kv managers have (`upstream_on`)
COMMON_MANAGER = "sglang.srt.disaggregation.common.conn.CommonKVManager"  # mooncake, nixl, mori (not fake)
MOONCAKE_MANAGER = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"


def upstream_on(obj: Any, name: str, *owners: str, default: Any = None) -> Any:
    """`obj.name` for an attribute upstream defines only on the classes `owners` ("module.Class", subclasses too):
    required on an object of one of them (UpstreamChanged on a rename), `default` on an object of any other class
    (another transfer backend, the fake one, None), which has no such attribute upstream."""
    if obj is not None and any(is_a(obj, owner) for owner in owners):
        return upstream(obj, name)
    return default


def _declared(obj: Any, by: str, attr: str, kind: str) -> Optional[Tuple[str, str]]:
    """`by`'s SWAPS entry (target, ref) for `attr` on `obj`'s class, None for another class; raises if undeclared."""
    from sglang.srt.managers.fork_core.fork_plugin import SWAPS

    entries = [(target, ref) for target, ref, k, _ in SWAPS
               if target.rpartition(".")[2] == attr and ref.partition(":")[0] == by and k == kind]
    if not entries:
        raise UpstreamChanged(f"{by} swaps {attr!r} ({kind}) but fork_plugin.SWAPS does not declare it: every "
                              "swap of an upstream attribute is declared there")
    return next((e for e in entries if is_a(obj, e[0].rpartition(".")[0])), None)


def is_a(obj: Any, owner: str) -> bool:
    """Whether `obj` is (or, a class, subclasses) upstream's class `owner` ("module.Class")."""
    classes = obj.__mro__ if isinstance(obj, type) else type(obj).__mro__
    return any(_qualname(c) == owner for c in classes)


# SWAPS (target, ref) -> [(weak ref to the object swapped on, weak ref to what was put there)]. Weak both: what was put
# there closes over the object (a kv manager's ledger, its original method), so a strong one would keep a manager
# upstream replaced alive for the process's life; entries of freed objects go at the next swap (the table stays as
# long as the live objects' swaps).
_APPLIED: Dict[Tuple[str, str], List[Tuple[Any, Any]]] = {}
_lock = threading.Lock()


def swap(obj: Any, attr: str, make: Callable[[Any], Any], *, by: str, kind: str = "instance") -> Optional[Any]:
    """Replace `obj.attr` (kind "instance") or class `obj`'s attribute ("class") with
    `make(original)`, as SWAPS declares for module `by`; None for another class."""
    entry = _declared(obj, by, attr, kind)
    if entry is None:
        return None
    original = upstream(obj, attr)
    new = make(original)
    if callable(new) and getattr(new, "__wrapped__", None) is None:
        new.__wrapped__ = original  # for _in_place: a later swap wraps an earlier one
    setattr(obj, attr, new)
    with _lock:  # a kv manager or a class, and what was put there: all take weak references
        for key, made in list(_APPLIED.items()):
            _APPLIED[key] = [(o, n) for o, n in made if o() is not None]
        _APPLIED.setdefault(entry, []).append((weakref.ref(obj), weakref.ref(new)))
    return new


def _in_place(obj: Any, attr: str, new: Any) -> bool:
    """Whether `new` is obj.attr or wrapped by it (later swaps wrap earlier ones)."""
    value = getattr(obj, attr, _MISSING)
    for _ in range(32):
        if value is new:
            return True
        value = getattr(value, "__wrapped__", _MISSING)
    return False


def swaps_applied(obj: Any, role: Optional[str] = None) -> Dict[str, bool]:
    """"target <- ref" -> whether that SWAPS entry for `obj`'s class in `role` was made on `obj` (or its class) and
    is still in place."""
    from sglang.srt.managers.fork_core.fork_plugin import SWAPS

    if obj is None:
        return {}
    out: Dict[str, bool] = {}
    for target, ref, _, r in SWAPS:
        owner, _, attr = target.rpartition(".")
        if (role is None or r in (role, "both")) and is_a(obj, owner):
            with _lock:
                made = [(weak(), new()) for weak, new in _APPLIED.get((target, ref), ())]
            out[f"{target} <- {ref}"] = any(
                o is not None and new is not None and (o is obj or (isinstance(o, type) and isinstance(obj, o)))
                and _in_place(o, attr, new) for o, new in made)
    return out


def manager_swaps_applied(mgr: Any, role: Optional[str] = None) -> Dict[str, bool]:
    """`swaps_applied` of a kv manager and of its transfer engine (paced_write swaps the engine's write)."""
    return {**swaps_applied(mgr, role), **swaps_applied(getattr(mgr, "engine", None), role)}


def check_at_start(mgr: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER each PD queue's `_init_kv_manager` (the last registered): stop the scheduler naming any swap SWAPS
    declares for this manager (or its transfer engine) that is not in place."""
    role = "prefill" if type(queue).__name__.startswith("Prefill") else "decode"
    missing = [t for t, ok in manager_swaps_applied(mgr, role).items() if not ok]
    if missing:
        raise UpstreamChanged(f"fork swaps declared in fork_plugin.SWAPS were not made on this {role} kv manager "
                              f"({_qualname(type(mgr))}): {', '.join(missing)}")

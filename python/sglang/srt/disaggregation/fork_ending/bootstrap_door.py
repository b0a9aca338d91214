"""A PD request's bootstrap fields checked where it enters the engine (docs/aborts.md, "Bad bootstrap fields"): a
value no transfer can use is a 400 naming the field, at once, before any request state exists.

Why: upstream's JSON contract gate (`/generate`) refuses only what int64 cannot hold (`bootstrap_room: 2**70`, a
string); a negative room passes it, reaches decode's scheduler and waits there for a transfer that cannot come
(upstream: no answer ever; the fork: 504 at the transfer deadline, 600 s by default). A port of 0 or 70000 fails the
same way. What the gateways send always passes: sglang-router and the mini LB draw rooms in [0, 2**63) and send the
prefill's host and bootstrap port (the port may be null: the prefill's default).

Invariant: on a prefill or decode server every generate call (HTTP, OpenAI routes, the Engine API) is checked before
upstream's `generate_request` runs (BEFORE hook): nothing is in `rid_to_state`, no peer is told, nothing reaches the
scheduler; what upstream's /generate contract gate refuses first (not an int64) has the field named in its 400 too
(`name_the_field`, the http_server patch). A server that is not PD is unaffected (upstream ignores the fields there). Pure checks, no state: any
thread (the tokenizer's event loop calls it)."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

ROOM_LIMIT = 2**63  # rooms are signed int64 on the engine (upstream's contract, the gateways' generators)
PORT_RANGE = (1, 65535)
FIELDS = ("bootstrap_room", "bootstrap_host", "bootstrap_port", "bootstrap_pair_key")


class BootstrapFieldError(ValueError):
    """A bootstrap field no transfer can use: upstream's generate routes answer a ValueError 400."""

    status_code = 400


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _room_ok(value: Any) -> bool:
    return _is_int(value) and 0 <= value < ROOM_LIMIT


def _host_ok(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _port_ok(value: Any) -> bool:
    return _is_int(value) and PORT_RANGE[0] <= value <= PORT_RANGE[1]


def _pair_key_ok(value: Any) -> bool:
    return isinstance(value, str)


# field -> (its check, what it accepts); None is always accepted (upstream's rules for a missing field apply)
RULES = {
    "bootstrap_room": (_room_ok, f"an integer 0 <= bootstrap_room < 2**63 ({ROOM_LIMIT})"),
    "bootstrap_host": (_host_ok, "a non-empty host name or address"),
    "bootstrap_port": (_port_ok, f"an integer port {PORT_RANGE[0]}..{PORT_RANGE[1]}, or null (the prefill's default)"),
    "bootstrap_pair_key": (_pair_key_ok, "a string"),
}


def _values(value: Any) -> Iterable[Tuple[Optional[int], Any]]:
    """(index in the batch form or None, value) of each value a field carries (a list: one per prompt)."""
    if isinstance(value, (list, tuple)):
        return enumerate(value)
    return [(None, value)]


def field_errors(obj: Any) -> List[str]:
    """Each bootstrap field of `obj` (a GenerateReqInput, single or batch form) that no transfer can use, named with
    its value and what it accepts."""
    errors = []
    for field in FIELDS:
        value = getattr(obj, field, None)
        if value is None:
            continue
        ok, accepts = RULES[field]
        for index, item in _values(value):
            if item is not None and not ok(item):
                where = field if index is None else f"{field}[{index}]"
                errors.append(f"{where}={item!r} is not valid: expected {accepts}")
                break  # one per field
    return errors


def name_the_field(contract_error: str, body: Any) -> str:
    """The message of upstream's /generate contract 400 with the bootstrap fields it refuses named first (its decoder
    says "expected ... OptionalInt64OrList" for a room of 2**70 or "7"); other messages unchanged (http_server patch,
    any server: the 400 is upstream's either way)."""
    if not isinstance(body, dict):
        return contract_error
    errors = field_errors(_Fields(body))
    return f"{'; '.join(errors)} ({contract_error})" if errors else contract_error


class _Fields:
    """A JSON body's bootstrap fields read as attributes (field_errors reads a GenerateReqInput)."""

    def __init__(self, body: dict):
        for field in FIELDS:
            setattr(self, field, body.get(field))


def check(tokenizer_manager: Any, obj: Any) -> None:
    """Raise BootstrapFieldError (400) naming every bad bootstrap field of `obj` on a prefill or decode server."""
    role = str(getattr(tokenizer_manager.disaggregation_mode, "value", "null"))
    if role not in ("prefill", "decode"):
        return
    errors = field_errors(obj)
    if errors:
        raise BootstrapFieldError(f"Invalid request on the {role} server: {'; '.join(errors)}. Nothing was started.")


def before_generate_request(tokenizer_manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE TokenizerManager.generate_request (the tokenizer's event loop, at the call, before upstream's generator
    exists): a bad bootstrap field is a 400 naming it."""
    check(tokenizer_manager, obj)

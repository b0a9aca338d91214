"""What a client of a test server sends and reads: HTTP calls (urllib, no pooling: each call is
its own connection), greedy /generate and its concurrent form, distinct prompts, and the
Prometheus text format."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Mapping, Optional, Sequence


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post_json(url: str, payload: Any, timeout: float = 120.0) -> tuple[int, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        body, status = e.read(), e.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def http_request(url: str, method: str, timeout: float = 30.0) -> tuple[int, bytes]:
    """A body-less request with any method (DELETE ...)."""
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def parse_prometheus(text: str) -> Dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} ('name' when unlabelled)."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            key, _, rest = line.rpartition("}")
            key += "}"
        else:
            key, _, rest = line.partition(" ")
        value = rest.split()[0]
        out[key] = float(value)
    return out


def metric_sum(metrics: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of every sample of `name` over all label sets (those with every one of
    `labels`, label=value, when given)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v for k, v in metrics.items()
        if (k == name or k.startswith(name + "{")) and all(w in k for w in want)
    )


def generate(url: str, text: str, max_new_tokens: int = 32, timeout: float = 120.0,
             sampling: Optional[Mapping[str, Any]] = None, **extra) -> Dict[str, Any]:
    """One greedy /generate; returns status, latency, output ids and text. `sampling`:
    sampling params merged over the greedy defaults (temperature 0, max_new_tokens);
    `extra`: other top-level fields of the request (rid, ...)."""
    if "sampling_params" in extra:
        raise TypeError("generate: pass sampling params as sampling=, merged over the greedy defaults")
    payload = {
        "text": text,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, **(sampling or {})},
        **extra,
    }
    t0 = time.monotonic()
    try:
        status, body = http_post_json(url + "/generate", payload, timeout=timeout)
    except Exception as e:
        status, body = None, repr(e)
    latency = time.monotonic() - t0
    ok = status == 200 and isinstance(body, dict)
    return {
        "status": status,
        "latency": latency,
        "output_ids": body.get("output_ids") if ok else None,
        "text": body.get("text") if ok else None,
        "meta": body.get("meta_info") if ok else None,
        "error": None if ok else body,
    }


def post_stream(url: str, payload: Any, timeout: float = 60.0) -> tuple[int, str]:
    """POST `payload` to `url` (a streaming endpoint: /generate with "stream": true, /v1/chat/completions) and read
    the whole answer: (status, body text); an HTTP error's status and body alike."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def stream_events(body: str) -> tuple[List[Any], bool]:
    """A stream's data events (JSON), and whether it ended with [DONE]."""
    data = [line[len("data:"):].strip() for line in body.splitlines() if line.startswith("data:")]
    done = bool(data) and data[-1] == "[DONE]"
    return [json.loads(d) for d in data if d != "[DONE]"], done


def generate_concurrently(url: str, prompts: Sequence[str], **kw) -> List[Dict[str, Any]]:
    """All prompts at once, one thread each; results in prompt order."""
    results: List[Optional[Dict[str, Any]]] = [None] * len(prompts)

    def run(i):
        results[i] = generate(url, prompts[i], **kw)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results  # type: ignore[return-value]


def prompts(n: int) -> List[str]:
    """n distinct prompts in the tiny tokenizer's vocabulary."""
    words = "the quick brown fox jumps over the lazy dog hello world paris london".split()
    return [
        f"request {i}: " + " ".join(words[(i + k) % len(words)] for k in range(5 + i % 7))
        for i in range(n)
    ]

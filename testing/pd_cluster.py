"""The harness's import point for tests, benches and the demo: real sglang servers on
loopback, brought up and taken apart again (`from testing.pd_cluster import ...`).

It holds no code of its own; each name lives in one module, lowest first (each imports
only those above it):

| module                   | what it owns                                                              |
|--------------------------|---------------------------------------------------------------------------|
| testing/polling.py       | `wait_until` (the one bounded wait), `ClusterError`                       |
| testing/ports.py         | `HOST`, `free_ports` (outside the ephemeral range, reserved machine-wide)  |
| testing/http_client.py   | `http_get`/`http_post_json`/`http_request`, `generate`, `prompts`, Prometheus text (`metric_sum`) |
| testing/processes.py     | `Server` (a launched process tree: freeze, kill, restart, metrics, resource report), `Deployment`, `start_all` |
| testing/deployments.py   | `PDCluster`, `Gateway`, `MiniLB`, `SingleServer`, the base flags and env, tensor-parallel args |

The assertions the tests share (nothing held, end causes, legs, closed loops) are in
testing/pd_checks.py; the fixtures in test/srt/conftest.py.
"""

from testing.deployments import (
    BALANCERS,
    BASE_ENV,
    BASE_SERVER_ARGS,
    PD_ROLES,
    REGISTER_TIMEOUT,
    TEST_GLOO_TIMEOUT_S,
    Gateway,
    MiniLB,
    PDCluster,
    SingleServer,
    tp_args,
    tp_env,
)
from testing.http_client import (
    generate,
    generate_concurrently,
    http_get,
    http_post_json,
    http_request,
    metric_sum,
    parse_prometheus,
    prompts,
)
from testing.polling import POLL_INTERVAL, ClusterError, wait_until
from testing.ports import HOST, free_port, free_ports
from testing.processes import DEFAULT_HEALTH_TIMEOUT, PYTHON_ENV, Deployment, Server, exited, fork_python, start_all

__all__ = [
    "BALANCERS", "BASE_ENV", "BASE_SERVER_ARGS", "PD_ROLES", "REGISTER_TIMEOUT", "TEST_GLOO_TIMEOUT_S",
    "Gateway", "MiniLB", "PDCluster", "SingleServer", "tp_args", "tp_env",
    "generate", "generate_concurrently", "http_get", "http_post_json", "http_request", "metric_sum",
    "parse_prometheus", "prompts",
    "POLL_INTERVAL", "ClusterError", "wait_until",
    "HOST", "free_port", "free_ports",
    "DEFAULT_HEALTH_TIMEOUT", "PYTHON_ENV", "Deployment", "Server", "exited", "fork_python", "start_all",
]

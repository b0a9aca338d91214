"""Shared fixtures: the tiny model, deployments of real servers started through one
factory (`deployments`) whose failures attach every server's log, the default 1P1D and
plain control server shared by the modules that only serve through them
(`shared_pd`, `shared_single`, see SharedDeployments), the queue harnesses. The
assertions shared by the tests (nothing held, client abort, legs, end-cause counter)
live in testing/pd_checks.py (tests import them from there), the servers and requests in
testing/pd_cluster.py.

Servers run under $SGLANG_FORK_PYTHON (see testing.pd_cluster).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import pytest

from testing.pd_checks import assert_idle
from testing.pd_cluster import Deployment, PDCluster, SingleServer, generate, start_all
from testing.tiny_model import ensure_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-llama"
LOG_LINES = 30

# Every deployment started through the factory and not yet torn down: a failing test
# (setup, call or teardown) gets the tail of each of their server logs.
_LIVE: "list[Deployment]" = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure, attach the tail of every live server log."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for d in list(_LIVE):
            for role, server in d.servers.items():
                report.sections.append((f"{role} log ({d.log_dir})", server.tail(LOG_LINES)))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model(TINY_MODEL_DIR)


# ----------------------------------------------------------------------------- shared deployments
#
# Starting servers is most of the suite's time (a server start is ~20-30 s of CPU on two
# cores). The default 1P1D ("pd": PDCluster(tiny model), mini LB) and the default plain
# control server ("single") are therefore started once and handed to every module that
# only serves through them; a module that kills, restarts or reconfigures servers (or
# needs other flags or env) starts its own through `deployments`.
#
# A module claims one with the module fixture `shared_pd` / `shared_single`. The claim
# checks the deployment when the module takes it and again when the module is done:
# every server healthy, nothing held (assert_idle), not paused, and a greedy probe
# request answered exactly as the first time (same weights, serving). A module that
# leaves it otherwise fails at its teardown, and the deployment is taken apart (the next
# module gets a fresh one): nothing a module did leaks into another. The modules that
# claim a shared deployment run next to each other (pytest_collection_modifyitems), and
# each shared deployment is taken apart after the last module that claims it.
#
# "liveness" is the 1P1D of the modules that kill, freeze and restart a peer
# (test_peer_liveness_e2e, test_room_ledger_e2e): fast peer-loss detection (a 2 s
# heartbeat, upstream's floor), the transfer deadline as the fallback (15 s, well above
# detection) and schedulers that reject a request naming a priority. Each knob is inert
# until its event (a lost peer, a transfer past 15 s, a priority), so the two modules
# share one start; each asserts the env it relies on (shared_env). A server a module
# killed is restarted by that module, on the same ports, before it hands it back.
LIVENESS_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2.0",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "15.0",
}
LIVENESS_ARGS = ("--abort-on-priority-when-disabled",)
SHARED_FIXTURES = {"shared_pd": "pd", "shared_single": "single", "shared_liveness": "liveness"}
SHARED_ROLES = {"pd": ("prefill", "decode"), "single": ("single",), "liveness": ("prefill", "decode")}
PROBE_TEXT = "shared deployment probe: the quick brown fox"
PROBE_TOKENS = 4
PROBE_TIMEOUT_S = 60.0


def _module_name(item) -> str:
    return item.module.__name__


def _shared_keys(item) -> "set[str]":
    return {key for name, key in SHARED_FIXTURES.items() if name in item.fixturenames}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Run the modules that claim a shared deployment next to each other (those that
    claim the 1P1D first, then those that claim only the control server, then those
    that claim the peer-liveness 1P1D; otherwise in collection order, each module's
    tests in their order), where the first of them was, and note the last module that
    claims each deployment."""
    modules: "list[str]" = []
    keys: "dict[str, set]" = {}
    by_module: "dict[str, list]" = {}
    for item in items:
        name = _module_name(item)
        if name not in by_module:
            modules.append(name)
            by_module[name] = []
            keys[name] = set()
        by_module[name].append(item)
        keys[name] |= _shared_keys(item)
    users = [m for m in modules if keys[m]]
    if users:
        grouped = sorted(users, key=lambda m: (*(key not in keys[m] for key in SHARED_ROLES), modules.index(m)))
        order = []
        for m in modules:
            if m == users[0]:
                order.extend(grouped)
            elif not keys[m]:
                order.append(m)
        items[:] = [item for m in order for item in by_module[m]]
        modules = order
    _LAST_USER.clear()
    for m in modules:
        for key in keys[m]:
            _LAST_USER[key] = m


_LAST_USER: "dict[str, str]" = {}  # shared key -> the last module (in run order) that claims it


# ----------------------------------------------------------------------------- levels
#
# Every test carries exactly one level mark (pyproject's markers: unit, pair, e2e), so that
# `-m unit` / `-m "not e2e"` select what they say. A test without one, or with two, fails
# at setup naming its marks (the rest of the suite runs).
LEVELS = ("unit", "pair", "e2e")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    levels = sorted({m.name for m in item.iter_markers() if m.name in LEVELS})
    if len(levels) != 1:
        pytest.fail(f"{item.nodeid}: needs exactly one level mark of {LEVELS} "
                    f"(pytestmark = pytest.mark.<level> in its module), has {levels or 'none'}", pytrace=False)


class _Failures:
    """A teardown's steps that must all run: `with failures.step():` keeps a step's Exception (a
    KeyboardInterrupt still stops the teardown at once); `raise_first()` after the last step raises
    the first one kept (SharedDeployments.teardown, Deployments.teardown)."""

    def __init__(self):
        self.errors: "list[Exception]" = []

    @contextlib.contextmanager
    def step(self):
        try:
            yield
        except Exception as e:
            self.errors.append(e)

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]


class SharedDeployments:
    """The session's shared deployments, keyed as SHARED_FIXTURES says, started on
    demand and taken apart after their last claiming module (or at the session's end)."""

    def __init__(self, model: Path):
        self.model = str(model)
        self.live: "dict[str, Deployment]" = {}
        self.probe: "dict[str, list]" = {}  # key -> the probe's first answer (output ids)

    def make(self, key: str) -> Deployment:
        if key == "pd":
            return PDCluster(self.model)
        if key == "single":
            return SingleServer(self.model)
        if key == "liveness":
            return PDCluster(self.model, prefill_env=LIVENESS_ENV, decode_env=LIVENESS_ENV,
                             prefill_args=LIVENESS_ARGS, decode_args=LIVENESS_ARGS)
        raise KeyError(key)

    def url(self, key: str) -> str:
        return self.live[key].url

    def check(self, key: str, when: str) -> None:
        """Healthy, idle, not paused, and serving what it served first (see above)."""
        d = self.live[key]
        for role, server in d.servers.items():
            if not server.is_alive():
                raise AssertionError(f"shared {key} {when}: {role} is not running")
        roles = SHARED_ROLES[key]
        assert_idle(d, roles, timeout=30)
        for role in roles:
            pause = d.resources(role)["pause"]
            if pause["paused"] or pause["mode"] is not None or pause["clock_paused"]:
                raise AssertionError(f"shared {key} {when}: {role} is paused: {pause}")
        r = generate(d.url, PROBE_TEXT, max_new_tokens=PROBE_TOKENS, timeout=PROBE_TIMEOUT_S)
        if r["status"] != 200 or r["meta"]["finish_reason"]["type"] == "abort":
            raise AssertionError(f"shared {key} {when}: probe request answered {r}")
        first = self.probe.setdefault(key, r["output_ids"])
        if r["output_ids"] != first:
            raise AssertionError(
                f"shared {key} {when}: probe answered {r['output_ids']}, first {first} (weights changed?)")
        assert_idle(d, roles, timeout=30)

    def take(self, *claims: "Claim", with_own: "tuple[Deployment, ...]" = ()) -> None:
        """Start the claimed deployments not running yet together with `with_own` (one
        start, all at once), then check each claimed one."""
        keys = [c.key for c in claims if not c.taken]
        new = {key: self.make(key) for key in keys if key not in self.live}
        for key, d in new.items():
            self.live[key] = d
            _LIVE.append(d)
        try:
            start_all(*new.values(), *with_own)
        except BaseException:
            for key in new:
                self.discard(key)
            raise
        for claim in claims:
            if not claim.taken:
                claim.taken = True
                self.check(claim.key, f"when {claim.module} took it")

    def discard(self, key: str) -> None:
        d = self.live.pop(key, None)
        self.probe.pop(key, None)
        if d is None:
            return
        if d in _LIVE:
            _LIVE.remove(d)
        d.teardown()

    def release(self, key: str, module: str) -> None:
        """A module is done with `key`: check it (a failed check takes it apart and
        fails the module), take it apart after its last module."""
        if key not in self.live:
            return
        try:
            self.check(key, f"after {module}")
        except BaseException:
            self.discard(key)
            raise
        if _LAST_USER.get(key, module) == module:
            self.discard(key)

    def teardown(self) -> None:
        failures = _Failures()
        for key in list(self.live):
            with failures.step():
                self.discard(key)
        failures.raise_first()


@pytest.fixture(scope="session")
def shared_deployments(tiny_model):
    pool = SharedDeployments(tiny_model)
    try:
        yield pool
    finally:
        pool.teardown()


class Claim:
    """One module's claim on a shared deployment (see SharedDeployments); `deployment`
    once taken (SharedDeployments.take, at the first use)."""

    def __init__(self, pool: SharedDeployments, key: str, module: str):
        self.pool, self.key, self.module = pool, key, module
        self.taken = False

    @property
    def deployment(self) -> Deployment:
        if not self.taken:
            self.pool.take(self)
        return self.pool.live[self.key]


def _claim(pool, key, request):
    claim = Claim(pool, key, request.module.__name__)
    yield claim
    if claim.taken:
        pool.release(key, claim.module)


@pytest.fixture(scope="module")
def shared_pd(shared_deployments, request):
    """A claim on the shared default 1P1D (PDCluster(tiny model), mini LB)."""
    yield from _claim(shared_deployments, "pd", request)


@pytest.fixture(scope="module")
def shared_single(shared_deployments, request):
    """A claim on the shared default plain control server."""
    yield from _claim(shared_deployments, "single", request)


@pytest.fixture(scope="module")
def shared_liveness(shared_deployments, request):
    """A claim on the shared peer-liveness 1P1D (LIVENESS_ENV, LIVENESS_ARGS)."""
    yield from _claim(shared_deployments, "liveness", request)


def shared_env(deployment: Deployment, roles, env, args=()) -> None:
    """Fail unless every role of a shared deployment runs with `env` and `args` (what
    the module's bounds and cases are derived from)."""
    for role in roles:
        have = deployment[role].env
        missing = {k: v for k, v in env.items() if have.get(k) != v}
        missing.update({a: "argument" for a in args if a not in deployment[role].argv})
        assert not missing, f"shared {role} lacks {missing}"


def resume_frozen(deployment: Deployment) -> None:
    """Resume every live server of a deployment (a test may have failed while it was
    frozen) before the deployment is checked and handed back."""
    for server in deployment.servers.values():
        if server.is_alive():
            server.resume()


class Deployments:
    """Starts deployments for one test module and takes them all apart after it
    (resuming frozen servers first). `pd(...)` takes PDCluster's keywords;
    `pd_and_single(shared_single, ...)` starts one next to the shared control server
    (at once, when that one is not running yet)."""

    def __init__(self, model: Path):
        self.model = str(model)
        self.started: "list[Deployment]" = []

    def _start(self, *deployments: Deployment, claims: "tuple[Claim, ...]" = ()) -> None:
        _LIVE.extend(deployments)
        self.started.extend(deployments)
        if claims:
            claims[0].pool.take(*claims, with_own=deployments)
        else:
            start_all(*deployments)

    def pd(self, **kwargs) -> PDCluster:
        cluster = PDCluster(self.model, **kwargs)
        self._start(cluster)
        return cluster

    @contextlib.contextmanager
    def scoped(self, *deployments: Deployment):
        """Start `deployments`; take them apart when the block ends (in a parametrized
        fixture: the next topology's deployment does not start beside this one)."""
        self._start(*deployments)
        try:
            yield
        finally:
            self.discard(*deployments)

    def discard(self, *deployments: Deployment) -> None:
        for d in deployments:
            if d in self.started:
                self.started.remove(d)
            if d in _LIVE:
                _LIVE.remove(d)
            resume_frozen(d)
            d.teardown()

    def pd_and_single(self, single: Claim, **kwargs):
        cluster = PDCluster(self.model, **kwargs)
        self._start(cluster, claims=(single,))
        return cluster, single.deployment

    def teardown(self) -> None:
        failures = _Failures()
        for d in reversed(self.started):
            with failures.step():
                resume_frozen(d)  # a test may have failed while it was frozen
            with failures.step():
                d.teardown()
            if d in _LIVE:
                _LIVE.remove(d)
        self.started.clear()
        failures.raise_first()


@pytest.fixture(scope="module")
def deployments(tiny_model):
    """The module's deployment factory (see Deployments)."""
    factory = Deployments(tiny_model)
    try:
        yield factory
    finally:
        factory.teardown()


@pytest.fixture(scope="module")
def pd_deployment(shared_deployments, shared_pd, shared_single):
    """(PDCluster, SingleServer): the shared default 1P1D and control server, started
    together when neither runs yet."""
    shared_deployments.take(shared_pd, shared_single)
    return shared_pd.deployment, shared_single.deployment


@pytest.fixture(scope="module")
def pd_cluster(pd_deployment) -> PDCluster:
    return pd_deployment[0]


@pytest.fixture(scope="module")
def single_server(pd_deployment) -> SingleServer:
    return pd_deployment[1]


# ----------------------------------------------------------------------------- topologies
#
# The end-to-end scenarios hold at every topology: a module parametrizes its deployment
# fixture with `topology_params(...)` and its tests run on TP=1 (the shared or own
# deployment, as before) and on each multi-rank topology, judged the same way (same
# statuses, same end causes). A multi-rank case is marked `tp` (`make test-tp` runs
# them all) and, unless the module is in CI's pick, `tp_matrix` (deselected by default:
# pyproject's addopts); docs/multi-rank.md gives each one's wall time.
FP32 = ("--dtype", "float32")


@dataclass(frozen=True)
class Topology:
    """Ranks per server. Multi-rank servers run float32: greedy completions then do not
    depend on the order of the ranks' partial sums (test_tensor_parallel_e2e)."""

    name: str
    tp: int = 1
    decode_tp: Optional[int] = None
    args: Tuple[str, ...] = ()

    @property
    def multi_rank(self) -> bool:
        return max(self.tp, self.decode_tp or self.tp) > 1

    def pd_kwargs(self, **kwargs) -> dict:
        """PDCluster's keywords for this topology over the module's own."""
        out = dict(kwargs, tp=self.tp, decode_tp=self.decode_tp)
        for side in ("prefill_args", "decode_args"):
            out[side] = (*self.args, *kwargs.get(side, ()))
        return out


TP1 = Topology("tp1")
TP2 = Topology("tp2", tp=2, args=FP32)
TP2_DECODE_TP1 = Topology("tp2-decode-tp1", tp=2, decode_tp=1, args=FP32)


def topology_params(*multi_rank: Topology, ci: Tuple[Topology, ...] = ()) -> list:
    """pytest params: TP=1, then each multi-rank topology marked `tp`, and `tp_matrix`
    unless it is in `ci` (CI's pick for the module)."""
    def marks(t):
        return [pytest.mark.tp] + ([] if t in ci else [pytest.mark.tp_matrix])

    return [pytest.param(TP1, id=TP1.name)] + [pytest.param(t, id=t.name, marks=marks(t)) for t in multi_rank]


def topology_pd(deployments: Deployments, topology: Topology, **kwargs):
    """A module fixture's body (`yield from`): its PDCluster (PDCluster's keywords) at
    `topology`, taken apart when the fixture ends."""
    cluster = PDCluster(deployments.model, **topology.pd_kwargs(**kwargs))
    with deployments.scoped(cluster):
        yield cluster


# Queue harnesses (testing/queue_harness.py): one of each per test module, with its
# idle snapshot as the baseline its tests return to.
@pytest.fixture(scope="module")
def prefill_h():
    from testing.queue_harness import PrefillHarness

    with PrefillHarness() as h:
        h.idle = h.snapshot()
        yield h


@pytest.fixture(scope="module")
def decode_h():
    from testing.queue_harness import DecodeHarness

    with DecodeHarness() as h:
        h.idle = h.snapshot()
        yield h


# The production Rust gateway (sglang-router, its defaults) with self-registered
# engines, a mini LB over the same engines and a plain control server.
@pytest.fixture(scope="module", params=topology_params(TP2, TP2_DECODE_TP1))
def gateway_deployment(deployments, shared_single, request):
    """(PDCluster(balancer="router"), MiniLB over its engines, a SingleServer): TP=1 beside
    the shared control server; multi-rank (TP 2 on both servers, or prefill TP 2 with decode TP 1) beside its
    own float32 control."""
    from testing.pd_cluster import MiniLB

    topology = request.param
    if topology.multi_rank:
        cluster = PDCluster(deployments.model, **topology.pd_kwargs(balancer="router"))
        single = SingleServer(deployments.model, args=FP32)
        own = (cluster, single)
        deployments._start(*own)
    else:
        cluster, single = deployments.pd_and_single(shared_single, balancer="router")
        own = (cluster,)
    mini = MiniLB(cluster["prefill"].url, cluster.bootstrap_port, cluster["decode"].url,
                  log_dir=str(cluster.log_dir))
    deployments._start(mini)
    try:
        yield cluster, mini, single
    finally:
        deployments.discard(mini, *own)


@pytest.fixture(scope="module")
def pd_hosts(request):
    """testing.hosts.TestHosts with prefill, decode and the balancer ("lb") each on a host of its own (the module's
    HOST_ROLES, if it names others); the module skips where network namespaces cannot be made (not root). Ask for
    it before `deployments`, so that the servers are torn down before their hosts."""
    from testing import hosts

    why = hosts.unavailable()
    if why:
        pytest.skip(why)
    with hosts.TestHosts(getattr(request.module, "HOST_ROLES", ("prefill", "decode", "lb"))) as made:
        yield made

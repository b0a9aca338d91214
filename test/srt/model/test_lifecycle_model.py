"""The lifecycle model (testing/lifecycle_model.py): a stateful property test of a PD request's life over the real
upstream queues with the fork's hooks, both servers in one process, the model playing the wire and the engine clock.

Two profiles (MODEL_PROFILE): `ci` (default, `make test`): derandomized, a fixed budget, replays identically;
`long` (`make test-model`): random examples for MODEL_SECONDS (default 1800), printing steps and steps/s; a
counterexample prints Hypothesis' reproduction blob (`@reproduce_failure`) and its shrunk step list.
Every counterexample becomes a named regression test in test_lifecycle_regressions.py.
"""

import os
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from testing.lifecycle_model import LifecycleMachine

pytestmark = pytest.mark.unit

PROFILE = os.environ.get("MODEL_PROFILE", "ci")
COMMON = dict(deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
CI = settings(max_examples=int(os.environ.get("MODEL_EXAMPLES", "300")), stateful_step_count=40, derandomize=True,
              **COMMON)
LONG_BATCH = settings(max_examples=50, stateful_step_count=60, derandomize=False, **COMMON)


@pytest.mark.skipif(PROFILE != "ci", reason="MODEL_PROFILE selects the long run")
def test_lifecycle_model():
    started, steps, seen = time.monotonic(), LifecycleMachine.total_steps, Counter(LifecycleMachine.seen)
    run_state_machine_as_test(LifecycleMachine, settings=CI)
    took = time.monotonic() - started
    reached = LifecycleMachine.seen - seen
    print(f"lifecycle model (ci): {LifecycleMachine.total_steps - steps} steps in {took:.1f}s; {dict(reached)}")
    # the fixed profile reaches recovery (not vacuous): an attempt started, and one that completed
    assert reached["recovery attempt 1 started"] and reached["recovered request answered 200 by attempt 1"], reached


@pytest.mark.skipif(PROFILE != "long", reason="the long run: MODEL_PROFILE=long (make test-model)")
def test_lifecycle_model_long():
    budget = float(os.environ.get("MODEL_SECONDS", "1800"))
    started, steps, batches = time.monotonic(), LifecycleMachine.total_steps, 0
    while time.monotonic() - started < budget:
        run_state_machine_as_test(LifecycleMachine, settings=LONG_BATCH)
        batches += 1
        took = time.monotonic() - started
        done = LifecycleMachine.total_steps - steps
        print(f"lifecycle model (long): {batches * LONG_BATCH.max_examples} examples, {done} steps, "
              f"{took:.0f}s, {done / took:.0f} steps/s; orderings reached: {dict(LifecycleMachine.seen)}", flush=True)

"""The lifecycle model (testing/lifecycle_model.py): a stateful property test of a PD request's life over the real
upstream queues with the fork's hooks, both servers in one process, the model playing the wire and the engine clock.

Two profiles (MODEL_PROFILE, testing/model_profiles.py): `ci` (default, `make test`): derandomized, a fixed budget,
replays identically; `long` (`make test-model`): random examples for MODEL_SECONDS (default 1800), printing steps and
steps/s; a counterexample prints Hypothesis' reproduction blob (`@reproduce_failure`) and its shrunk step list.
Every counterexample becomes a named regression test in test_lifecycle_regressions.py.
"""

import os
import time
from collections import Counter

import pytest
from hypothesis.stateful import run_state_machine_as_test

from testing.lifecycle_model import LifecycleMachine
from testing.model_profiles import PROFILE, ci_settings, long_run, long_settings

pytestmark = pytest.mark.unit

CI = ci_settings(examples=int(os.environ.get("MODEL_EXAMPLES", "300")), steps=40)
LONG_BATCH = long_settings(examples=50, steps=60)


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
    long_run(LifecycleMachine, "lifecycle model", LONG_BATCH)

"""The pair model (testing/pair_model.py): a stateful property test of a request's life over the real mooncake pair
(two processes, upstream's managers and their background threads, TCP on loopback), the rules choosing what the
schedulers, the clients and the operator do, the threads running in between.

Two profiles, as the lifecycle model's (MODEL_PROFILE, testing/model_profiles.py): `ci` (default, `make test`):
derandomized, a fixed budget (the rules replay; the threads' timing is the machine's); `long` (`make test-model`):
random examples for MODEL_SECONDS (default 1800). A counterexample's report lists the example's steps as run
(`PairMachine.trail`; the threads' timing may not replay, so Hypothesis may call it flaky); it becomes a named test
beside the pair tests.
"""

import os
import time
from collections import Counter

import pytest
from hypothesis.stateful import run_state_machine_as_test

from testing.model_profiles import PROFILE, ci_settings, long_run, long_settings
from testing.pair_model import PairMachine

pytestmark = pytest.mark.pair

CI = ci_settings(examples=int(os.environ.get("PAIR_MODEL_EXAMPLES", "40")), steps=30)
LONG_BATCH = long_settings(examples=20, steps=40)


@pytest.fixture
def machine():
    try:
        yield PairMachine
    finally:
        PairMachine.pairs.close()


@pytest.mark.skipif(PROFILE != "ci", reason="MODEL_PROFILE selects the long run")
def test_pair_model(machine):
    started, steps, seen = time.monotonic(), machine.total_steps, Counter(machine.seen)
    run_state_machine_as_test(machine, settings=CI)
    reached = machine.seen - seen
    print(f"pair model (ci): {machine.total_steps - steps} steps in {time.monotonic() - started:.1f}s; {dict(reached)}")
    # not vacuous: the fixed profile reaches completions, every failed write's 500, a worker's break taken, client
    # aborts on both sides and a release of each (at some stage: which one depends on the threads' timing)
    for what in ("decode calm 200", "decode kv 500", "decode aux 500", "decode state 500", "transfer worker break taken",
                 "abort on prefill", "abort on decode", "release on prefill", "release on decode"):
        assert sum(n for key, n in reached.items() if key.startswith(what)), (what, dict(reached))


@pytest.mark.skipif(PROFILE != "long", reason="the long run: MODEL_PROFILE=long (make test-model)")
def test_pair_model_long(machine):
    long_run(machine, "pair model", LONG_BATCH)

"""How the stateful models (test/srt/model) run: MODEL_PROFILE `ci` (the default, `make test`): derandomized, a fixed
budget of examples, the same rule lists every run; `long` (`make test-model`): random examples in batches for
MODEL_SECONDS (default 1800) per model, printing steps and what was reached after each batch."""

from __future__ import annotations

import os
import time

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

PROFILE = os.environ.get("MODEL_PROFILE", "ci")
_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])


def ci_settings(examples: int, steps: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, derandomize=True, **_COMMON)


def long_settings(examples: int, steps: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, derandomize=False, **_COMMON)


def long_run(machine, name: str, batch: settings) -> None:
    """Batches of random examples of `machine` (a RuleBasedStateMachine with class counters `total_steps` and
    `seen`) until MODEL_SECONDS have passed; a counterexample fails the run with Hypothesis' report."""
    budget = float(os.environ.get("MODEL_SECONDS", "1800"))
    started, steps, batches = time.monotonic(), machine.total_steps, 0
    while time.monotonic() - started < budget:
        run_state_machine_as_test(machine, settings=batch)
        batches += 1
        took = time.monotonic() - started
        done = machine.total_steps - steps
        print(f"{name} (long): {batches * batch.max_examples} examples, {done} steps, {took:.0f}s, "
              f"{done / took:.0f} steps/s; reached: {dict(machine.seen)}", flush=True)

"""Schemathesis against the live OpenAPI schema of a running service: every operation gets generated valid and
invalid requests (with a valid key); no response may be a 5xx or disagree with the schema (status codes,
headers, content types, bodies). At least PACKSCORE_FUZZ_CASES (default 1,000) cases in all."""

import os

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from tests.service_harness import Service

CASES = int(os.environ.get("PACKSCORE_FUZZ_CASES", 1000))
# Schema-valid is not always valid: an empty query, empty label list or token id past the vocabulary passes the
# JSON schema and gets the engine's typed 400 (docs/score-semantics.md), which this check would call a rejection.
# And for schema-invalid requests, "must be rejected" misfires twice over: our Authorization header replaces
# schemathesis's mutation of it, and unknown query parameters are ignored (as most HTTP APIs do). Invalid bodies
# are checked for rejection by test_security_inputs.py; here they must still get no 5xx and a documented answer.
EXCLUDED = {
    schemathesis.GenerationMode.POSITIVE: [schemathesis.checks.positive_data_acceptance],
    schemathesis.GenerationMode.NEGATIVE: [schemathesis.checks.positive_data_acceptance,
                                           schemathesis.checks.negative_data_rejection],
}


def test_openapi_fuzz(live_service: Service) -> None:
    schema = schemathesis.openapi.from_url(f"{live_service.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    modes = list(schemathesis.GenerationMode)  # schema-valid and schema-invalid requests
    # Operations with the fewest inputs first: hypothesis stops early on small input spaces (/healthz has none),
    # and the cases they leave go to the operations after them.
    def inputs(pair: tuple) -> int:
        return len(list(pair[0].iter_parameters())) + len(pair[0].get_request_payload_content_types())

    pairs = sorted(((operation, mode) for operation in operations for mode in modes), key=inputs)
    headers = {"Authorization": f"Bearer {live_service.key}"}
    count = 0
    for done, (operation, mode) in enumerate(pairs):
        per_run = -(-(CASES - count) // (len(pairs) - done)) + 2  # an even share of the cases still to run

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=per_run, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            nonlocal count
            count += 1
            case.call_and_validate(base_url=live_service.base_url, headers=headers, timeout=30,
                                   excluded_checks=EXCLUDED[mode])

        try:
            check()
        except Unsatisfiable:
            # An operation with nothing to mutate (no parameters, no body: /healthz) has no invalid requests.
            assert mode == schemathesis.GenerationMode.NEGATIVE
    print(f"\nschemathesis: {count} cases over {len(operations)} operations")
    assert count >= CASES

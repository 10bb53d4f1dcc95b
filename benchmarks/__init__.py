"""Benchmarks: long runs that print figures (`python -m benchmarks.<name>`), outside the shipped packages. They
may use the tests' harness (tests/service_harness.py, tests/object_stores.py); the product imports neither."""

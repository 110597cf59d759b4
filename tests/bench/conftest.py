"""Fixtures of the bench tests (tests/bench/, marker `bench`, run by `make bench` only)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def serve_bench_work(tmp_path_factory):
    """One work folder for bench/serve/plan.py and soak.py in a session: the tiny run they
    serve (bench/serve/serve.py's `build_run`) is trained once, not once per script (2 Train
    runs and a Ray instance each). Neither changes it: plan serves version 0, soak a copy."""
    return tmp_path_factory.mktemp("bench-serve")

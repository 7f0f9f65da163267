"""``bench/fuzz_bench.py``: the frame decoder, message validators, codec payload checks and session state
machine under seeded fuzzing. A small run in the default suite, the reported 100,000-iteration run slow-marked;
both must end with zero unexpected exceptions."""

from __future__ import annotations


import pytest
from bench_support import load_bench

@pytest.fixture(scope="module")
def fuzz_bench():
    return load_bench("fuzz_bench")


def _check(result: dict, iterations: int) -> None:
    assert result["iterations"] == iterations
    assert result["unexpected_exceptions"] == 0, result["unexpected"]
    by = result["by_strategy"]
    assert sum(c["inputs"] for c in by.values()) == iterations
    for name in ("bit_flips", "structure", "tensor_payload"):  # mutations that sometimes stay valid
        assert by[name]["refused"] > 0 and by[name]["accepted"] > 0, (name, by[name])
    assert by["random_bytes"]["refused"] > 0 and by["truncation"]["refused"] > 0
    assert by["session_sequence"]["messages_refused"] > 0
    assert {"bad_frame", "bad_type", "bad_tensor", "decompress"} <= set(result["refusal_codes"])


def test_a_short_fuzz_run_raises_nothing_unexpected(fuzz_bench):
    _check(fuzz_bench.fuzz(6000, seed=1), 6000)


def test_the_fuzzer_reports_an_unexpected_exception(fuzz_bench, monkeypatch):
    """The harness can fail: a decoder that raises something other than ProtocolError is caught and counted."""
    real = fuzz_bench.P.decode_message

    def broken(data, limits=None):
        if len(data) % 7 == 0:
            raise KeyError("decoder bug")
        return real(data, limits)

    monkeypatch.setattr(fuzz_bench.P, "decode_message", broken)
    result = fuzz_bench.fuzz(600, seed=2)
    assert result["unexpected_exceptions"] > 0 and "KeyError" in result["unexpected"][0]["error"]


@pytest.mark.slow
def test_one_hundred_thousand_iterations(fuzz_bench):
    _check(fuzz_bench.fuzz(100_000, seed=0), 100_000)

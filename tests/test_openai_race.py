"""Issue 42's "tenancy and bad input", as a short race: ``benchmarks/openai_race.py``'s probes
(the same request kinds, the same checks) from 8 clients for 5 s against ``flowrl serve openai``
in a process of its own, keyed for alice (who owns ``models:/race/1``) and bob. The benchmark
is a script, not a package: its module is loaded from its file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "openai_race.py"


@pytest.fixture(scope="module")
def openai_race():  # noqa: ANN201 - the benchmark's module
    spec = importlib.util.spec_from_file_location("openai_race", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["openai_race"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("openai_race", None)


def test_bad_input_and_other_namespaces_never_break_the_endpoint(openai_race, tmp_path):
    result = openai_race.run(tmp_path, clients=8, seconds=5)
    report = openai_race.render(result)
    assert result.server_errors == 0, report
    assert not result.transport_errors, report  # no dropped connection, no timeout
    assert result.server_tracebacks == 0, report
    for probe in openai_race.PROBES:  # each kind drawn, each answered as it should be
        tally = result.tallies.get(probe.kind)
        assert tally is not None and tally.statuses.total() > 0, f"{probe.kind} never drawn"
        assert set(tally.statuses) <= set(probe.expect), f"{probe.kind}: {tally.statuses}"
        assert tally.unexpected == 0, f"{probe.kind}: {tally.examples}"
    assert result.server_alive
    assert result.after == {openai_race.BASE: 200, openai_race.REGISTERED: 200}
    assert result.passed()

"""The latency suite's profiles as data (no model is built): every case can run and compares with what it should, the
full profile's runs are the full profile, and benchmarks/README.md lists exactly their cases."""

import pathlib
import re
import types

import pytest
from test_latency import (
    ACCELERATE_AT,
    CACHES,
    FULL_RUNS,
    PROFILES,
    case_id,
    case_of,
    seed_raises,
    slots,
)

from harness import split_format
from shapes import routing_shape

README = pathlib.Path(__file__).parent / "README.md"
RUN_LIMIT_S = 600  # the longest run the H200 is lent for
START_S = 45  # a run beyond its cases' own seconds: start-up, reference tokens, the report (40-45 s measured)


def cases(p: dict) -> list[tuple[tuple, bool]]:
    return [(c, False) for c in p["decode"]] + [(c, True) for c in p["prefill"]]


@pytest.mark.parametrize("name", PROFILES)
def test_every_case_can_run(name):
    """The resident model holds every expert; accelerate has no cache of its own and runs at ACCELERATE_AT; the
    seed never at a batch whose step can route to more experts than its slots (it raises there); a graph only
    decodes (one eager prompt is all a graph would capture); no two fractions give one case the same slots."""
    seen = set()
    for (shape, routing, system, fraction, size), prefill in cases(PROFILES[name]):
        assert system != "unmodified" or fraction == 1.0
        assert system != "accelerate" or fraction == ACCELERATE_AT
        assert not (
            system == "seed" and not prefill and seed_raises(shape, size, slots(shape, fraction))
        )
        assert not (prefill and "graph" in system)
        key = (shape, routing, system, slots(shape, fraction), size, prefill)
        assert key not in seen, key
        seen.add(key)
        assert prefill or size in PROFILES[name]["timing"]  # every batch has its steps and rounds


@pytest.mark.parametrize("name", PROFILES)
def test_every_row_has_its_floor_in_its_run(name):
    """A cached row's limit ratio needs the resident model at its batch or prompt, and the report takes it from the
    same run (under any routing of the shape: the resident model computes the same whatever the routing); the seed
    and accelerate run only where an asyncmoe row compares with them."""
    ours = cases(PROFILES[name])
    groups = {(c[0], c[1], c[4], prefill) for c, prefill in ours if c[2].startswith("asyncmoe")}
    resident = {(c[0], c[4], p) for c, p in ours if c[2] == "unmodified"}
    for (shape, routing, system, _, size), prefill in ours:
        assert (shape, size, prefill) in resident
        if system in ("seed", "accelerate"):
            assert (shape, routing, size, prefill) in groups


@pytest.mark.parametrize("name", ["link", "link-fp8"])
def test_the_link_profiles_have_each_split(name):
    """Each cached case of a link profile has its compute (its format fully resident) and, with prefetch, its graph
    without prefetch (the trace's, under an oracle) in the same run: the report's split and targets need both."""
    ours = {(c[0], c[1], c[2], c[3]) for c, _ in cases(PROFILES[name])}
    for shape, routing, system, fraction in ours:
        if fraction == 1.0:
            continue
        fmt = split_format(system)[1]
        assert (shape, "trace", f"asyncmoe-graph-{fmt}" if fmt else "unmodified", 1.0) in ours
        if "-prefetch" in system:
            none = "trace" if routing.startswith("oracle") else routing
            assert (shape, none, system.replace("-prefetch", ""), fraction) in ours


def test_the_full_profile_is_its_runs_and_its_caches_differ_on_every_shape():
    """`full` is full-1, full-2 and full-3 together, each shape in one run (its rows compare within one process);
    its two cache sizes are distinct slot counts below the experts on every shape."""
    runs = {name: cases(PROFILES[name]) for name in FULL_RUNS}
    assert sorted(c for ours in runs.values() for c in ours) == sorted(cases(PROFILES["full"]))
    shapes = [{c[0] for c, _ in ours} for ours in runs.values()]
    assert sum(map(len, shapes)) == len(set().union(*shapes)) == 4
    for shape in set().union(*shapes):
        counts = {slots(shape, f) for f in CACHES}
        assert len(counts) == len(CACHES) and max(counts) < routing_shape(shape)[0], shape


def readme_rows(run: str) -> list[tuple[str, int]]:
    """(case id, seconds: measured, or estimated where marked *) of the table under README.md's heading of `run`."""
    section = README.read_text().split(f"### {run}:")[1].split("\n### ")[0]
    return [
        (m[1], int(m[2]))
        for m in re.finditer(r"^\| `([^`]+)` \|.*\| (\d+)\*? \|$", section, re.MULTILINE)
    ]


@pytest.mark.parametrize("run", FULL_RUNS)
def test_readme_lists_each_run_and_its_seconds_fit_the_run(run):
    """The README's table of a run is that run's cases, and their seconds leave a tenth of a run to spare."""
    rows = readme_rows(run)
    assert sorted(i for i, _ in rows) == sorted(
        case_id(c, prefill) for c, prefill in cases(PROFILES[run])
    )
    assert START_S + sum(s for _, s in rows) <= 0.9 * RUN_LIMIT_S


def test_a_profile_without_prefill_cases_collects():
    """pytest parametrizes an empty case list with a placeholder that is no case (`link`, `formats-1`)."""
    item = types.SimpleNamespace(callspec=types.SimpleNamespace(params={"prefill_case": object()}))
    assert case_of(item) is None
    assert all(PROFILES[name]["decode"] or PROFILES[name]["prefill"] for name in PROFILES)

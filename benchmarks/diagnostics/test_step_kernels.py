"""The layer comparison of step_kernels.py: which kernels a layer adds, and which shared ones waited or ran longer."""

from step_kernels import compare_layers, layer


def kernels(*specs):
    """(name, start, length) -> the profiler's events."""
    return [{"name": n, "start": s, "end": s + d} for n, s, d in specs]


def test_a_layer_runs_from_one_ensure_decision_to_the_next():
    events = kernels(
        ("_cache_step", 0, 10), ("_slot_gemv", 12, 5), ("norm", 20, 2),
        ("_cache_step", 30, 10),  # a prefetch's decision: no GEMV right after it
        ("attention", 60, 5),
        ("_cache_step", 100, 10), ("_slot_gemv", 111, 5),
        ("_cache_step", 200, 10), ("_slot_gemv", 211, 5),
    )  # fmt: skip
    assert [e["name"] for e in layer(events, which=0)] == [
        "_cache_step",
        "_slot_gemv",
        "norm",
        "_cache_step",
        "attention",
    ]
    assert [e["start"] for e in layer(events, which=1)] == [100, 111]


def test_compare_layers_names_the_added_kernels_and_the_waits():
    base = kernels(("_cache_step", 0, 10), ("gemv", 10, 5), ("combine", 16, 4), ("norm", 21, 2))
    other = kernels(
        ("_cache_step", 0, 10), ("gate", 10, 6), ("gemv", 10, 5), ("combine", 25, 4), ("norm", 30, 6)
    )  # fmt: skip
    lines = compare_layers(base, other)
    assert lines[0] == "layer: 23.0 -> 36.0 us"
    assert [line.split()[:2] for line in lines[1:]] == [
        ["only", "here"],
        ["shared", "combine"],
        ["shared", "norm"],
    ]
    assert "waited  +9.0" in lines[2] and "ran  +0.0" in lines[2]
    assert "waited  +0.0" in lines[3] and "ran  +4.0" in lines[3]

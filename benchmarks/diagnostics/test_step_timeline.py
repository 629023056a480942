"""The span arithmetic that splits a step's time into copying, compute alone and idle (step_timeline.py)."""

from step_timeline import COPY_KERNEL, copy_spans, gaps, long_holes, outside, union


def test_union_merges_overlapping_and_touching_spans():
    assert union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]


def test_outside_is_the_part_no_covered_span_holds():
    covered = union([(1, 3), (5, 6)])
    assert outside((0, 10), covered) == 7
    assert outside((2, 5.5), covered) == 2  # 3..5
    assert outside((1, 3), covered) == 0


def test_gaps_are_the_holes_between_spans():
    assert gaps(union([(0, 2), (3, 4), (4, 5), (9, 10)])) == [1, 4]
    assert gaps([(0, 1)]) == []


def test_long_holes_split_at_a_whole_layer():
    copy = COPY_KERNEL + "_x"
    events = [
        {"name": copy, "start": 0, "end": 100},
        {"name": copy, "start": 105, "end": 200},  # 5 us: a kernel boundary, not counted
        {"name": "compute", "start": 150, "end": 400},
        {"name": copy, "start": 250, "end": 300},  # 50 us: compute a copy did not cover
        {"name": copy, "start": 600, "end": 700},  # 300 us: a whole layer with nothing to copy
    ]
    holes = long_holes(gaps(copy_spans(events)), steps=2)
    assert holes == {"partial": 0.5, "partial_ms": 0.025, "whole": 0.5, "whole_ms": 0.15}

"""decode_step.py with the prefetch gate open for budget-1 plans (MIN_PRECISION 0), as it is for the others (0.5).

    cd benchmarks && PYTHONPATH=.. python ../docs/results/2026-11-30/precision_probe.py --caches 32 --no-eager --budgets 1 0 --sources gate gate+temporal+transition

Why: on decode_step's random routing the gate predictor's likeliest non-resident expert per layer is routed by
the call it was fetched for ~19% of the time (CPU study), under the gate's 50%, so the gate shuts. At cache 32 the
step is compute-bound (link idle ~85% of it): do the wasted copies cost less than the caught misses save?
"""
import sys

import asyncmoe
from asyncmoe.cache import expert_cache

sys.path.insert(0, "")  # run from benchmarks/: decode_step, shapes
import decode_step  # noqa: E402

_compile = asyncmoe.compile


def compile(model, **kw):
    plan = kw.get("prefetch")
    ungated = isinstance(plan, asyncmoe.Prefetch) and plan.budget == 1
    expert_cache.PREFETCH_CONSTANTS["MIN_PRECISION"] = 0.0 if ungated else 0.5
    return _compile(model, **kw)


decode_step.asyncmoe.compile = compile
decode_step.main()

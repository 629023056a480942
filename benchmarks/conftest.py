import json
import os
import pathlib
import sys

import pytest

# `baselines`, `harness`, `shapes`: for the suite's tests and those in diagnostics/
sys.path.insert(0, str(pathlib.Path(__file__).parent))


def pytest_addoption(parser):
    parser.addoption(
        "--profile",
        metavar="NAME",
        help="the latency suite's cases: smoke, quick, full-1, full-2, full-3, full, link, formats-1 or "
        "formats-2 (test_latency.py; benchmarks/README.md lists them)",
    )
    parser.addoption(
        "--quick", action="store_true", help="--profile quick: the OLMoE shape at batch 1, ~150 s"
    )
    parser.addoption(
        "--cases-json",
        metavar="PATH",
        help="pytest-benchmark's JSON of the cases passed so far, "
        "rewritten after each: a run cut short (a time limit, a crash) keeps what it finished",
    )


_finished = pytest.StashKey[list]()
_machine = pytest.StashKey[tuple]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """--cases-json: pytest-benchmark writes its JSON only as pytest exits, and a run stopped mid-case (SIGINT
    from a time limit landing in CUDA work, a crash) can end with none, losing every case it had finished. This
    writes the same JSON, through pytest-benchmark's own hooks, after every case that passes."""
    outcome = yield
    path, config = item.config.getoption("--cases-json"), item.config
    bench = getattr(item, "funcargs", {}).get("benchmark")
    if not path or outcome.excinfo or bench is None or bench.stats is None:
        return
    if _machine not in config.stash:
        config.stash[_machine] = (
            config.hook.pytest_benchmark_generate_machine_info(config=config),
            config.hook.pytest_benchmark_generate_commit_info(config=config),
        )
    finished = config.stash.setdefault(_finished, [])
    finished.append(bench.stats)
    machine, commit = config.stash[_machine]
    data = config.hook.pytest_benchmark_generate_json(
        config=config,
        benchmarks=finished,
        include_data=True,
        machine_info=machine,
        commit_info=commit,
    )
    partial = pathlib.Path(path + ".partial")
    partial.write_text(json.dumps(data, indent=4))
    os.replace(partial, path)  # whole or not at all, whenever the run stops


def pytest_collection_modifyitems(items):
    """The latency suite's cases that build the same model (test_latency.model_key) run one after another, so
    it is built once: each item moves up to the first item of its key, the order otherwise kept."""
    keys = []
    for item in items:
        found = item.module.case_of(item) if hasattr(item.module, "case_of") else None
        keys.append(item.module.model_key(found[0]) if found else item.nodeid)
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    items[:] = [items[i] for i in sorted(range(len(items)), key=lambda i: (first[keys[i]], i))]

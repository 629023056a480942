import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # `baselines`, `decode_step`


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", help="the GPU profile that fits one 10-minute run")


def pytest_collection_modifyitems(items):
    """The latency suite's cases that build the same model (test_latency.model_key) run one after another, so
    it is built once: each item moves up to the first item of its key, the order otherwise kept."""
    keys = []
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        case = params.get("case") or params.get("prefill_case")
        keys.append(item.module.model_key(case) if case else item.nodeid)
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    items[:] = [items[i] for i in sorted(range(len(items)), key=lambda i: (first[keys[i]], i))]

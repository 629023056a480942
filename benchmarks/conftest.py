import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # `baselines`, `decode_step`


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", help="the GPU profile that fits one 10-minute run")

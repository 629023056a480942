"""Build experts.c (with the headers it includes) with the system C compiler at first use, and load it with ctypes.

Why not a torch C++ extension: the kernels and the worker never touch torch or Python objects (the worker must
run without the GIL), so a plain shared library built in a couple of seconds by `cc` is all they need, and it
loads without a C++ toolchain matching torch's. The library is cached per user under a name hashed from every
source file, the flags, the compiler and the CPU (`-march=native`), and renamed into place atomically, so concurrent
first uses neither race nor see a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

# the one translation unit: it includes the headers beside it
SOURCE = Path(__file__).with_name("experts.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread")
# instruction sets the kernels are built for: "native" takes the best the host has (AVX-512 with BF16, AVX-512, AVX2,
# else plain C); the others build the narrower paths on the same host, so tests reach every path that host can run,
# and "pairs-emulated" (tests only) runs AVX512-BF16's pairs paths as plain C on an AVX2 build
ISA_FLAGS = {
    "native": (),
    "avx512": ("-mno-avx512bf16",),
    "avx2": ("-mno-avx512f",),
    "scalar": ("-DAMC_SCALAR",),
    "pairs-emulated": ("-mno-avx512f", "-DAMC_EMULATE_PAIRS"),
}
COMPILERS = ("cc", "gcc", "clang")

_loaded: dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()


def cache_dir() -> Path:
    root = os.environ.get("ASYNCMOE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "asyncmoe"
    )
    return Path(root) / "cpu"


def find_compiler() -> str:
    names = ([os.environ["CC"]] if os.environ.get("CC") else []) + list(COMPILERS)
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError(
        "asyncmoe's CPU expert kernels are built with the system C compiler at first use; none was found "
        f"(tried {', '.join(names)}): install gcc (`apt-get install gcc`, `dnf install gcc`) or clang, "
        "or point the CC environment variable at a C compiler."
    )


def _cpu_identity() -> str:
    """What `-march=native` resolves from: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [
                line
                for line in f
                if line.startswith(("model name", "flags", "Features", "CPU part"))
            ]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def sources() -> list[Path]:
    """Every file the build reads: experts.c and the headers it includes."""
    return sorted(SOURCE.parent.glob("*.[ch]"))


def _key(compiler: str, flags: tuple[str, ...]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for path in sources():
        h.update(path.name.encode() + b"\0" + path.read_bytes())
        h.update(b"\0")
    for part in (
        " ".join(flags).encode(),
        compiler.encode(),
        version.encode(),
    ):
        h.update(part)
        h.update(b"\0")
    h.update(_cpu_identity().encode())
    return h.hexdigest()[:16]


def compile_library(isa: str = "native") -> Path:
    """The shared library for `isa`, compiled unless the cache holds it."""
    if isa not in ISA_FLAGS:
        raise ValueError(
            f"isa={isa!r}: the CPU kernels are built for {', '.join(map(repr, ISA_FLAGS))}"
        )
    compiler = find_compiler()
    flags = FLAGS + ISA_FLAGS[isa]
    directory = cache_dir()
    target = directory / f"experts-{isa}-{_key(compiler, flags)}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=target.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, str(SOURCE), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(
                f"building asyncmoe's CPU expert kernels failed ({' '.join(cmd)}):\n{result.stderr.strip()}"
            )
        os.replace(tmp, target)  # atomic: another process sees the old name or the whole new file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(isa: str = "native") -> ctypes.CDLL:
    """experts.c built for `isa` and loaded, once per process; kernels.py declares its functions' signatures."""
    with _lock:
        if isa not in _loaded:
            _loaded[isa] = ctypes.CDLL(str(compile_library(isa)))
        return _loaded[isa]

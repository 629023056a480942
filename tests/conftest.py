import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when a kernel is decorated, so it must be set before asyncmoe is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402


def _interpreter_index_for_numpy_2_4() -> None:
    """Triton's interpreter before 3.7 (torch 2.11's triton 3.6) turns a scalar it holds as a one-element array into a
    Python index with `int(array)`, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted"): every
    kernel loop with a runtime bound then fails under TRITON_INTERPRET=1. Later Triton squeezes the array first;
    so does this, where the interpreter is the older one."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or "int(self.handle.data)" not in inspect.getsource(patch):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def _interpreter_scans_each_module_once() -> None:
    """Speed alone, the same patches: on each launch, and again on each call of a @triton.jit helper inside one
    (a tl.sort makes dozens), the interpreter's `_patch_builtin` walks every member of triton.language, of its
    tensor class and of tl.math (`inspect.getmembers`) to wrap the builtins among them: half of an interpreted
    kernel's time. Which members are builtins does not change, so this lists them at a module's first walk
    (nothing has wrapped them yet: only `_patch_builtin` does) and then wraps each that is still unwrapped, as
    the walk would."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    walk = getattr(interpreter, "_patch_builtin", None)
    if walk is None or "inspect.getmembers(pkg)" not in inspect.getsource(walk):
        return
    is_builtin = interpreter.tl.core.is_builtin
    builtins = {}  # module or class -> the names of its builtins

    def patched(pkg, builder, scope):
        if pkg not in builtins:
            builtins[pkg] = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for name in builtins[pkg]:
            member = getattr(pkg, name)
            if is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_index_for_numpy_2_4()
    _interpreter_scans_each_module_once()

transformers.logging.set_verbosity_error()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

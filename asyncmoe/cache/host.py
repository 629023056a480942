"""Host store: every expert tensor of a layer in pinned host memory, and the CUDA view ops read it
through.

Why not `Tensor.pin_memory()`: torch's caching host allocator rounds every block up to a power of
two (a 604 MB request takes 1 GB), which on a 100 GB expert set wastes tens of GB. We allocate
ordinary memory of the exact size and pin it in place with `cudaHostRegister`
(docs/decisions.md#pinned-in-place).

Why a CUDA view: a CPU tensor among a compiled graph's inputs makes Inductor skip CUDA graphs, and
torch ops refuse to mix devices. The driver maps registered memory into the GPU's address space;
wrapping that device pointer (which need not equal the host pointer) in a CUDA tensor lets torch
ops and Triton kernels read host memory directly over PCIe, from inside a captured graph.
"""

from __future__ import annotations

import ctypes
import os

import torch

ALIGN = 256  # bytes; keeps every tensor in a block aligned for vector loads and grouped_mm


def available_host_bytes() -> int:
    """Memory the kernel can give us without swapping (MemAvailable), or total RAM if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def check_host_memory(needed: int, what: str) -> None:
    """Fail before allocating, with numbers, rather than let the OOM killer end the process
    mid-copy."""
    available = available_host_bytes()
    if needed > available:
        raise MemoryError(
            f"{what}: needs {human_bytes(needed)} of host memory but only {human_bytes(available)} "
            "is available "
            "(MemAvailable in /proc/meminfo). Free host memory, use a machine with more RAM, or "
            "offload fewer layers."
        )


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class PinnedBlock:
    """`nbytes` of host memory, pinned in place for as long as this object lives."""

    def __init__(self, nbytes: int):
        release_deferred()
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        self.nbytes = nbytes
        self.registered = False
        if nbytes:
            # portable | mapped
            rc = int(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 1 | 2))
            if rc != 0:
                hint = (
                    "the OS refused to lock that much memory (check `ulimit -l` and free RAM)"
                    if rc == 2
                    else ("see cudaError_t in the CUDA runtime documentation")
                )
                raise RuntimeError(
                    f"cudaHostRegister of {human_bytes(nbytes)} failed with CUDA "
                    f"error {rc}: {hint}."
                )
            self.registered = True

    def __del__(self):
        if self.registered:
            self.registered = False
            _deferred.append(self.data)
            release_deferred()


# Blocks that died while a CUDA graph was being captured. Python's GC may collect a dead model at
# any moment, also mid-capture, where cudaHostUnregister is illegal: it invalidates the capture,
# fails, and the memory is freed still registered (the next cudaHostRegister at that address then
# fails with error 712). Such a block keeps its memory until unpinning is legal again.
_deferred: list[torch.Tensor] = []


def release_deferred() -> None:
    if _deferred and not torch.cuda.is_current_stream_capturing():
        while _deferred:
            torch.cuda.cudart().cudaHostUnregister(_deferred.pop().data_ptr())


_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3  # CUpointer_attribute in cuda.h


def _device_pointer(host_ptr: int) -> int:
    libcuda = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_uint64()
    rc = libcuda.cuPointerGetAttribute(
        ctypes.byref(dev),
        ctypes.c_int(_CU_POINTER_ATTRIBUTE_DEVICE_POINTER),
        ctypes.c_uint64(host_ptr),
    )
    if rc != 0:
        raise RuntimeError(
            f"cuPointerGetAttribute(DEVICE_POINTER) failed with CUDA driver error {rc}"
        )
    return dev.value


def uva_view(block: PinnedBlock, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor over the whole pinned block: reads go over PCIe, no copy is made. The
    view holds the block."""
    view = device_view(block.data, device)
    # carved views keep this tensor (their _base) and so the block alive
    view._asyncmoe_block = block
    return view


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the pinned (registered or pinned-allocated) CPU tensor `host`: the same
    memory, so what a kernel writes through it the host reads with no copy and no sync.

    Built as Inductor's cudagraph trees build storages, from the raw pointer: `torch.as_tensor` of a
    `__cuda_array_interface__` would ask the runtime which device owns the pointer, which fails for
    a device alias that differs from the host address. The storage does not own the memory: the view
    holds `host`.
    """
    torch.cuda.init()
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    nbytes = host.numel() * host.element_size()
    storage = torch._C._construct_storage_from_data_pointer(
        _device_pointer(host.data_ptr()), device, nbytes
    )
    view = torch.empty(0, dtype=host.dtype, device=device).set_(storage).view(host.shape)
    view._asyncmoe_host = host
    return view


def host_flag(value: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One int32 in pinned host memory, as the host reads it and as `device` writes it (the same
    tensor on the CPU): a kernel's store through the device's view reaches the host with no copy and
    no sync."""
    host = torch.full((1,), value, dtype=torch.int32, pin_memory=device.type == "cuda")
    return host, device_view(host, device) if device.type == "cuda" else host


def carve(flat: torch.Tensor, specs: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Views of shape/dtype `specs` laid out back to back (each aligned) in the uint8 tensor
    `flat`."""
    out, offset = [], 0
    for shape, dtype in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        out.append(flat[offset : offset + nbytes].view(dtype).view(shape))
        offset += aligned(nbytes)
    return out


def block_bytes(specs: list[tuple[torch.Size, torch.dtype]]) -> int:
    return sum(aligned(torch.Size(s).numel() * d.itemsize) for s, d in specs)

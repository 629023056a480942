"""Copy device-chosen experts with the copy engine inside a CUDA graph: `slots[dst[i]] = host[src[i]]`, i < count.

A measured alternative to the gather-copy kernel (`copy_bandwidth.py --paths switch`; it lost, see
docs/decisions.md#copies-at-the-links-speed). The copy engine needs addresses the host knows, and in a captured
step only the device knows which experts move. CUDA graph switch nodes (driver 12.8+) close that gap: row i of a
call is a switch over the E experts whose body e is a copy-engine memcpy of expert e into staging row i. A
one-thread kernel sets each switch to `src[i]` (or past the end, so no body runs, for i >= count), the switches
run on parallel branches, and the gather-copy kernel moves the staged rows into their slots at HBM speed.

torch has no API for switch nodes, so this talks to the driver through ctypes: it reads the graph being
captured, adds the switch nodes to it and makes them the capture's next dependencies. The handle-setting
kernel is the PTX below, compiled from the CUDA shown beside it; load it (`_set_switches`) before a capture.

Dims: E experts, C slots, M planned copies (rows).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from asyncmoe.kernels.gather_copy import gather_copy_triton

# extern "C" __global__ void set_switches(const long long* src, const long long* count, int first, int n,
#                                         unsigned int none, Handles hs) {  // struct Handles { u64 h[32]; }
#   long long real = *count;
# #pragma unroll 1  // one thread, in order: concurrent cudaGraphSetConditional calls are undefined behaviour
#   for (int i = 0; i < n; ++i)
#     cudaGraphSetConditional(hs.h[i], first + i < real ? (unsigned int)src[first + i] : none);
# }
# nvcc -arch=compute_75 -ptx set_switches.cu (then .version 8.4: loads on drivers from CUDA 12.4 up)
_SET_SWITCHES_PTX = b"""
.version 8.4
.target sm_75
.address_size 64
.extern .func cudaGraphSetConditional
(
    .param .b64 cudaGraphSetConditional_param_0,
    .param .b32 cudaGraphSetConditional_param_1
)
;
.visible .entry set_switches(
    .param .u64 set_switches_param_0,
    .param .u64 set_switches_param_1,
    .param .u32 set_switches_param_2,
    .param .u32 set_switches_param_3,
    .param .u32 set_switches_param_4,
    .param .align 8 .b8 set_switches_param_5[256]
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<11>;
    .reg .b64 %rd<21>;
    ld.param.u64 %rd12, [set_switches_param_0];
    ld.param.u64 %rd13, [set_switches_param_1];
    ld.param.u32 %r5, [set_switches_param_2];
    ld.param.u32 %r6, [set_switches_param_3];
    ld.param.u32 %r7, [set_switches_param_4];
    mov.b64 %rd20, set_switches_param_5;
    setp.lt.s32 %p1, %r6, 1;
    @%p1 bra $L__BB0_5;
    cvta.to.global.u64 %rd15, %rd13;
    ld.global.u64 %rd1, [%rd15];
    cvt.s64.s32 %rd18, %r5;
    cvta.to.global.u64 %rd16, %rd12;
    mul.wide.s32 %rd17, %r5, 8;
    add.s64 %rd19, %rd16, %rd17;
    mov.u32 %r9, 0;
$L__BB0_2:
    .pragma "nounroll";
    ld.param.u64 %rd8, [%rd20];
    setp.le.s64 %p2, %rd1, %rd18;
    mov.u32 %r10, %r7;
    @%p2 bra $L__BB0_4;
    ld.global.u32 %r10, [%rd19];
$L__BB0_4:
    {
    .param .b64 param0;
    st.param.b64 [param0+0], %rd8;
    .param .b32 param1;
    st.param.b32 [param1+0], %r10;
    call.uni cudaGraphSetConditional, (param0, param1);
    }
    add.s64 %rd20, %rd20, 8;
    add.s64 %rd19, %rd19, 8;
    add.s64 %rd18, %rd18, 1;
    add.s32 %r9, %r9, 1;
    setp.lt.s32 %p3, %r9, %r6;
    @%p3 bra $L__BB0_2;
$L__BB0_5:
    ret;
}
"""
HANDLES_PER_LAUNCH = 32  # the kernel's by-value handle array

_NODE_CONDITIONAL = 13  # CU_GRAPH_NODE_TYPE_CONDITIONAL
_COND_SWITCH = 2  # CU_GRAPH_COND_TYPE_SWITCH
_SET_DEPENDENCIES = 1  # CU_STREAM_SET_CAPTURE_DEPENDENCIES
_MEMORY_UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED: a UVA address, host or device
_CAPTURE_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE


class _Conditional(ctypes.Structure):  # CUDA_CONDITIONAL_NODE_PARAMS
    _fields_ = [
        ("handle", ctypes.c_uint64),
        ("type", ctypes.c_int),
        ("size", ctypes.c_uint),
        ("graphs", ctypes.POINTER(ctypes.c_void_p)),
        ("ctx", ctypes.c_void_p),
    ]


class _NodeParams(ctypes.Structure):  # CUgraphNodeParams: 256 bytes, the union padded to 29 long longs
    _fields_ = [
        ("type", ctypes.c_int),
        ("reserved0", ctypes.c_int * 3),
        ("conditional", _Conditional),
        ("pad", ctypes.c_byte * (29 * 8 - ctypes.sizeof(_Conditional))),
        ("reserved2", ctypes.c_longlong),
    ]


class _Memcpy3D(ctypes.Structure):  # CUDA_MEMCPY3D
    _fields_ = [
        (f"{side}{name}", kind)
        for side in ("src", "dst")
        for name, kind in [
            ("XInBytes", ctypes.c_size_t),
            ("Y", ctypes.c_size_t),
            ("Z", ctypes.c_size_t),
            ("LOD", ctypes.c_size_t),
            ("MemoryType", ctypes.c_int),
            ("Host", ctypes.c_void_p),
            ("Device", ctypes.c_uint64),
            ("Array", ctypes.c_void_p),
            ("reserved", ctypes.c_void_p),
            ("Pitch", ctypes.c_size_t),
            ("Height", ctypes.c_size_t),
        ]
    ] + [("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t)]


class _Handles(ctypes.Structure):
    _fields_ = [("h", ctypes.c_uint64 * HANDLES_PER_LAUNCH)]


class DriverError(RuntimeError):
    pass


_P, _U64, _SIZE, _INT, _UINT = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
_SIGNATURES = {  # the driver entry points used, by their versioned names (CUDA 12.3+ signatures)
    "cuGetErrorName": [_INT, _P],
    "cuDriverGetVersion": [_P],
    "cuCtxGetCurrent": [_P],
    "cuModuleLoadData": [_P, ctypes.c_char_p],
    "cuModuleGetFunction": [_P, _P, ctypes.c_char_p],
    "cuLaunchKernel": [_P, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _P, _P, _P],
    "cuStreamGetCaptureInfo_v3": [_P, _P, _P, _P, _P, _P, _P],
    "cuStreamUpdateCaptureDependencies_v2": [_P, _P, _P, _SIZE, _UINT],
    "cuGraphConditionalHandleCreate": [_P, _P, _P, _UINT, _UINT],
    "cuGraphAddNode_v2": [_P, _P, _P, _P, _SIZE, _P],
    "cuGraphAddMemcpyNode": [_P, _P, _P, _SIZE, _P, _P],
}


def driver(signatures: dict[str, list]) -> ctypes.CDLL:
    """The CUDA driver library, with the argument types of `signatures`' entry points set (each returns CUresult)."""
    lib = ctypes.CDLL("libcuda.so.1")  # loaded once by the process; this returns its handle
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


@functools.cache
def _driver() -> ctypes.CDLL:
    return driver(_SIGNATURES)


def check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(rc, ctypes.byref(name))
        raise DriverError(f"{what} failed: CUDA driver error {rc} ({(name.value or b'?').decode()})")


@functools.cache
def _set_switches(device: int) -> ctypes.c_void_p:
    """The handle-setting kernel, loaded into `device`'s current context."""
    del device  # a cache key: one module per device's context
    module, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check(_driver().cuModuleLoadData(ctypes.byref(module), _SET_SWITCHES_PTX), "loading the set_switches PTX")
    check(_driver().cuModuleGetFunction(ctypes.byref(fn), module, b"set_switches"), "cuModuleGetFunction")
    return fn


def supported() -> bool:
    """Switch nodes need a CUDA 12.8 driver; the copy path needs the current stream to be capturing."""
    version = ctypes.c_int()
    try:
        check(_driver().cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    except OSError:
        return False
    return version.value >= 12080


def _capture(stream: int) -> tuple[ctypes.c_void_p, list[ctypes.c_void_p]]:
    """The graph `stream` is capturing into and the nodes its next work depends on."""
    status, graph = ctypes.c_int(), ctypes.c_void_p()
    deps, edges, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_void_p(), ctypes.c_size_t()
    check(
        _driver().cuStreamGetCaptureInfo_v3(
            ctypes.c_void_p(stream),
            ctypes.byref(status),
            None,
            ctypes.byref(graph),
            ctypes.byref(deps),
            ctypes.byref(edges),
            ctypes.byref(n),
        ),
        "cuStreamGetCaptureInfo",
    )
    if status.value != _CAPTURE_ACTIVE:
        raise RuntimeError("switch_copy runs only while the current CUDA stream is capturing a graph")
    return graph, [ctypes.c_void_p(deps[i]) for i in range(n.value)]


def _memcpy(body: ctypes.c_void_p, dst: int, src: int, nbytes: int, ctx: ctypes.c_void_p) -> None:
    p = _Memcpy3D(srcMemoryType=_MEMORY_UNIFIED, srcDevice=src, dstMemoryType=_MEMORY_UNIFIED, dstDevice=dst)
    p.WidthInBytes, p.Height, p.Depth = nbytes, 1, 1
    node = ctypes.c_void_p()
    check(_driver().cuGraphAddMemcpyNode(ctypes.byref(node), body, None, 0, ctypes.byref(p), ctx), "memcpy node")


def _switch(graph, deps, handle, bodies: int, ctx) -> tuple[ctypes.c_void_p, list[ctypes.c_void_p]]:
    """Add a switch node after `deps`; return it and its `bodies` body graphs."""
    p = _NodeParams(type=_NODE_CONDITIONAL)
    p.conditional = _Conditional(handle=handle, type=_COND_SWITCH, size=bodies, ctx=ctx)
    node = ctypes.c_void_p()
    dep_array = (ctypes.c_void_p * len(deps))(*[d.value for d in deps])
    check(
        _driver().cuGraphAddNode_v2(ctypes.byref(node), graph, dep_array, None, len(deps), ctypes.byref(p)),
        "adding a switch node (needs a CUDA 12.8 driver)",
    )
    return node, [ctypes.c_void_p(p.conditional.graphs[e]) for e in range(bodies)]


def switch_copy(
    hosts: list[torch.Tensor],  # [E, ...] each, UVA-addressable (pinned host memory or its device view)
    slots: list[torch.Tensor],  # [C, ...] each
    stages: list[torch.Tensor],  # [M, ...] each: staging rows
    src: torch.Tensor,  # [M] int64 expert ids
    dst: torch.Tensor,  # [M] int64 distinct slot ids
    count: torch.Tensor,  # [1] int64 number of real pairs
    rows: torch.Tensor,  # [M] int64 arange(M): staging row of each pair
) -> None:
    """Capture the copies of `slots[dst[i]] = hosts[src[i]]`, i < count, into the graph being captured on the
    current stream: M switch nodes, on parallel branches, each body one copy-engine memcpy per tensor of an
    expert into staging row i; then the gather-copy kernel puts the staged rows into their slots."""
    if src.dtype != torch.int64 or count.dtype != torch.int64:
        raise TypeError(f"switch_copy takes int64 src and count, got {src.dtype} and {count.dtype}")
    E, M = hosts[0].shape[0], src.numel()
    stream = torch.cuda.current_stream()
    graph, deps = _capture(stream.cuda_stream)
    ctx = ctypes.c_void_p()
    check(_driver().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    handles = []
    for _ in range(M):
        h = ctypes.c_uint64()
        check(_driver().cuGraphConditionalHandleCreate(ctypes.byref(h), graph, ctx, 0, 0), "conditional handle")
        handles.append(h.value)
    fn = _set_switches(stream.device.index)
    for first in range(0, M, HANDLES_PER_LAUNCH):
        chunk = handles[first : first + HANDLES_PER_LAUNCH]
        args = [
            ctypes.c_void_p(src.data_ptr()),
            ctypes.c_void_p(count.data_ptr()),
            ctypes.c_int(first),
            ctypes.c_int(len(chunk)),
            ctypes.c_uint(E),
            _Handles((ctypes.c_uint64 * HANDLES_PER_LAUNCH)(*chunk)),
        ]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        check(
            _driver().cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(stream.cuda_stream), params, None),
            "launching set_switches",
        )
    _, deps = _capture(stream.cuda_stream)
    ends = []
    for i, h in enumerate(handles):
        node, bodies = _switch(graph, deps, h, E, ctx)
        for e, body in enumerate(bodies):
            for host, stage in zip(hosts, stages):
                _memcpy(body, stage[i].data_ptr(), host[e].data_ptr(), stage[i].numel() * stage.element_size(), ctx)
        ends.append(node)
    end_array = (ctypes.c_void_p * M)(*[n.value for n in ends])
    check(
        _driver().cuStreamUpdateCaptureDependencies_v2(
            ctypes.c_void_p(stream.cuda_stream), end_array, None, M, _SET_DEPENDENCIES
        ),
        "cuStreamUpdateCaptureDependencies",
    )
    for stage, slot in zip(stages, slots):
        gather_copy_triton([stage], [slot], rows, dst, count)

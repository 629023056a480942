/*
 * asyncmoe's CPU expert kernels and the request worker: the host as a second executor.
 *
 * The expert MLP of a set of (token, expert) pairs, computed from the host store where the experts live:
 *     out[p] = down_e(gate(up_e(x[t])))     for pair p = (t, e)
 * in float32 accumulation, for every format of asyncmoe/formats.py (dense f32/bf16/f16 in either layout, fp8
 * block-wise in either layout, mxfp4 and int4 stored [N, K/2]). With bf16 inputs the activation between the
 * projections is rounded to bf16, as the model computes it, and where the host has AVX512-BF16 weights stored
 * [N, K] are multiplied with bf16 inputs in pairs (dot4_pairs, dot16_pairs, dot8_pairs). Pairs are grouped by expert
 * so that each weight is read once for all of its tokens; each projection is split over output rows across a
 * persistent thread pool, so that one token uses every thread (at batch 1 the work is a stream of weights from
 * DRAM).
 *
 * The worker is a C thread that polls a request block in (pinned) host memory, written by the GPU inside a
 * captured decode step: it never takes the Python GIL and never calls the CUDA driver.
 *
 * Dims: E experts, T tokens, P pairs, H hidden, I intermediate; a projection maps K inputs to N outputs, stored
 * as R rows of Q columns ([N, K], or [K, N] when transposed).
 * Plain-torch definitions of the same math: reference.py; the ctypes side: kernels.py and worker.py.
 *
 * One translation unit, built by one `cc` call (build.py): the parts below are headers included once each, so that
 * the kernels inline across them as they would in one file. By concern:
 *     common.h          the interface with ctypes, the formats' scalar definitions, where a matrix's bytes are
 *     isa.h             the vector wrappers over AVX-512 / AVX2 / plain C, and which bf16 pairs paths a build takes
 *     kernels_dense.h   f32 / bf16 / f16: decoding, the dot over decoded float32 weights, bf16 pairs
 *     kernels_fp8.h     fp8 block-wise: decoding, the fused dot, pairs
 *     kernels_4bit.h    mxfp4 and int4: decoding, the fused dot, pairs
 *     project.h         a projection's rows sent to their format's kernel
 *     pool.h            the thread pool and the workspace it owns
 *     mlp.h             the expert MLP of a set of pairs (amc_experts)
 *     worker.h          the request channel with the GPU and the worker thread that serves it
 */
#define _GNU_SOURCE
#include "mlp.h"
#include "worker.h"

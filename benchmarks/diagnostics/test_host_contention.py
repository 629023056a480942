"""host_contention.py's CPU side: the loop's rate over the calls inside a window, from a real loop on this CPU."""

import time

from host_contention import CpuLoop
from host_probe import cpu_layer

from asyncmoe.compute.cpu import Pool


def test_the_rate_counts_the_calls_that_ended_inside_the_window():
    loop = CpuLoop(cpu_layer("bf16", 2, 64, 32), None, 64, 2)
    loop.ends = [1.0, 2.0, 3.0, 4.0, 5.0]
    # 2 experts of 3 * 64 * 32 bf16 weights a call: 24,576 bytes; inside [1.5, 4.5]: three ends, two calls between
    assert loop.gb_per_s(1.5, 4.5) == 2 * 24_576 / 2.0 / 1e9


def test_a_loop_computes_until_stopped():
    pool = Pool(1)
    loop = CpuLoop(cpu_layer("bf16", 2, 64, 32), pool, 64, 2)
    loop.start()
    time.sleep(0.2)
    loop.stop.set()
    loop.join()
    pool.close()
    assert len(loop.ends) > 2 and loop.gb_per_s(loop.ends[0], loop.ends[-1]) > 0

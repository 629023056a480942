"""Hybrid execution: a cached layer's misses split between the link (copied into slots) and the host's
CPU (computed from the host store), by a cost model calibrated at compile."""

"""Expert compute: each routed pair's MLP from the slots, dense and quantized, with its Triton
kernels."""

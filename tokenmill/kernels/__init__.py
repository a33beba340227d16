"""Per-layer ops (native C++ CPU kernels and their pure-torch reference) and the CPU facts
that choose between them."""

"""The native C++ CPU kernels (built once per machine), the linears that call them, and the
CPU facts that choose between them; ``model/ops.py`` is the per-layer interface a model
calls, native or its pure-torch reference."""

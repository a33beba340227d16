"""``python -m tokenmill.kernels``: build the native CPU kernels now (the set-up step)."""

from __future__ import annotations

import sys
import time

from tokenmill.kernels.cpu import cpu_info
from tokenmill.kernels.native import build_name, load_native

if __name__ == "__main__":
    print(f"CPU: {cpu_info().describe()}", file=sys.stderr)
    print(f"building {build_name()} (cached after the first time) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    ok = load_native(verbose="-v" in sys.argv)
    print(
        f"{'ready' if ok else 'unavailable: the pure-torch path will run'} in {time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )

"""What naming a model by its Hub id costs at start: `tokenmill serve ID` against `tokenmill serve PATH`
for a model already in the Hub cache, from the command to its first answer, and the peak memory.

    python bench/hub_start.py [--rounds 5] [--folder /tmp/smollm2-hf]

The bundled GGUF (and, with ``--folder``, a Hugging Face folder) is put in a fresh Hub cache by
`tokenmill pull` from the tests' stand-in for the Hub on 127.0.0.1 (tests/hub_standin.py); the
stand-in is then stopped and ``HF_ENDPOINT`` points at a closed port, so the id's starts prove they
make no request. Each round starts the server by id and by the snapshot's path (the same files),
in alternating order, at the defaults; the time is from ``Popen`` to the reply of a one-token
completion; the memory is the peak resident set (``VmHWM``) of the server's processes, summed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.hub_standin import HubStandIn  # noqa: E402
from tokenmill.kernels.cpu import cpu_info  # noqa: E402
from tokenmill.loadgen.server_process import free_port  # noqa: E402
from tokenmill.model.paths import default_model_path  # noqa: E402


def tree(pid: int) -> list[int]:
    out = [pid]
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += tree(int(child))
    return out


def peak_rss(pid: int) -> int:
    total = 0
    for p in tree(pid):
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
    return total


def first_answer(model: str, env: dict) -> tuple[float, int]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill", "serve", model, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read())
            try:
                body = {"prompt": "Hello", "max_tokens": 1}
                reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
                if reply.status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.02)
        elapsed = time.perf_counter() - start
        return elapsed, peak_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--folder", type=Path, default=None, help="a Hugging Face folder to serve the same way")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hub_start.json")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="hub-start-"))
    hub = HubStandIn()
    hub.start()
    models = {"GGUF": ("bench-org/SmolLM2-135M-Instruct-GGUF:Q4_1", None)}
    hub.add_commit("bench-org/SmolLM2-135M-Instruct-GGUF", {"SmolLM2-135M-Instruct-Q4_1.gguf": default_model_path()})
    if args.folder is not None:
        hub.add_folder("bench-org/SmolLM2-135M-Instruct", args.folder)
        models["HF folder"] = ("bench-org/SmolLM2-135M-Instruct", None)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_HOME": str(home)}
    for kind, (model, _) in models.items():
        pulled = subprocess.run(
            [sys.executable, "-m", "tokenmill", "pull", model],
            env=env | {"HF_ENDPOINT": hub.endpoint},
            capture_output=True,
            text=True,
            check=True,
        )
        models[kind] = (model, pulled.stdout.strip().splitlines()[-1])
    hub.stop()
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"  # nobody there: a request would fail the start
    results: dict = {"cpu": cpu_info().model, "rounds": args.rounds, "models": {}}
    for kind, (model, path) in models.items():
        runs: dict[str, list] = {"id": [], "path": []}
        for r in range(args.rounds):
            order = [("id", model), ("path", path)] if r % 2 == 0 else [("path", path), ("id", model)]
            for label, name in order:
                runs[label].append(first_answer(name, env))
        row = {label: {"seconds": [t for t, _ in v], "peak_bytes": [m for _, m in v]} for label, v in runs.items()}
        med = {label: statistics.median(row[label]["seconds"]) for label in row}
        mem = {label: statistics.median(row[label]["peak_bytes"]) for label in row}
        row["id_minus_path_s"] = med["id"] - med["path"]
        results["models"][kind] = {"id": model, "path": path, **row}
        print(
            f"{kind}: serve ID {med['id']:.2f} s, {mem['id'] / 2**20:.0f} MiB; serve PATH {med['path']:.2f} s, "
            f"{mem['path'] / 2**20:.0f} MiB; the id costs {med['id'] - med['path']:+.3f} s (medians of {args.rounds})"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

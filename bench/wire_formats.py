"""The engine-core pipe's format, chosen by measurement: a step's Out message (the
biggest and most frequent: one per step) packed and unpacked with msgpack (what
engine/pipe/messages.py uses), pickle and json, per message, best of several rounds.

    .venv/bin/python bench/wire_formats.py

Two shapes: 32 decoding sequences with a token each (plain decode), and the same with 5
top logprobs each. pickle is measured as a bound only: it would let a message run code
when decoded, which the design rules out (engine/pipe/wire.py).
"""

from __future__ import annotations

import json
import pickle
import sys
from dataclasses import asdict
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quant_linear import best_ms
from tokenmill.engine.pipe.messages import Out, decode, encode
from tokenmill.engine.stats import EngineSnapshot


def message(rows: int, top: int) -> Out:
    deltas = []
    for i in range(rows):
        lps = [-0.25] if top else None
        tops = [[[100 + j, -0.5 - j] for j in range(top)]] if top else None
        deltas.append([f"req-{i:04d}-0", [1234 + i], lps, tops, None, None, None, 1733400000.0 + i, 0, None, None])
    return Out(deltas, asdict(EngineSnapshot()))


def main() -> None:
    formats = {
        "msgpack": (lambda w: msgpack.packb(w, use_bin_type=True), lambda b: msgpack.unpackb(b, raw=False)),
        "pickle": (lambda w: pickle.dumps(w, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads),
        "json": (lambda w: json.dumps(w).encode(), json.loads),
    }
    for rows, top in ((32, 0), (32, 5)):
        msg = message(rows, top)
        print(f"Out, {rows} sequences, top logprobs {top}:")
        for name, (dump, load) in formats.items():
            data = dump(encode(msg))
            assert decode(load(data)) == msg
            us = 1e3 * best_ms(lambda dump=dump, load=load, msg=msg: decode(load(dump(encode(msg)))), calls=2000)
            print(f"  {name:8s} {len(data):6d} bytes  {us:7.1f} us encode+pack+unpack+decode")


if __name__ == "__main__":
    main()

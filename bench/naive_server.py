"""The naive baseline server: transformers `generate`, one request at a time.

What a first attempt at serving looks like: a global lock around `model.generate`,
each request served alone from start to finish. It speaks the same OpenAI
/v1/completions (streaming, usage) as tokenmill, so `tokenmill bench serve` measures
both the same way.

    python bench/naive_server.py --port 8001    # then: tokenmill bench serve --base-url http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def build(model_path: str) -> FastAPI:
    import transformers

    from tokenmill.model.paths import default_model_path

    path = default_model_path() if model_path is None else Path(model_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    lock = asyncio.Lock()  # one request at a time, from its start to its last byte
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "naive", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        ids = tok(body["prompt"], return_tensors="pt").input_ids
        max_tokens = int(body.get("max_tokens") or 16)
        streamer = transformers.TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        result: dict = {}

        def work() -> None:
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens if body.get("ignore_eos") else 0,
                    do_sample=False,
                    streamer=streamer,
                    pad_token_id=tok.eos_token_id,
                )
                result["n"] = out.shape[1] - ids.shape[1]

        await lock.acquire()
        thread = threading.Thread(target=work, daemon=True)
        thread.start()

        def usage():
            n = result.get("n", 0)
            return {"prompt_tokens": ids.shape[1], "completion_tokens": n, "total_tokens": ids.shape[1] + n}

        async def pieces():
            it = iter(streamer)
            while True:
                piece = await asyncio.to_thread(next, it, None)
                if piece is None:
                    await asyncio.to_thread(thread.join)  # generate has returned: usage is known
                    return
                yield piece

        if not body.get("stream"):
            try:
                text = "".join([p async for p in pieces()])
            finally:
                lock.release()
            return JSONResponse(
                {
                    "id": "naive",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": "naive",
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": usage(),
                }
            )

        async def sse():
            try:
                async for piece in pieces():
                    if piece:
                        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': piece, 'finish_reason': None}]})}\n\n"
            finally:
                lock.release()
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    uvicorn.run(build(args.model), host="127.0.0.1", port=args.port, log_level="warning")

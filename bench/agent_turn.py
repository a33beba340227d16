"""openai-agents against `tokenmill serve`: one agent turn with a function tool,
through the SDK's default model (the Responses API), streamed and not.

openai-agents pins versions of starlette and mcp of its own, so it runs in a venv of
its own; the server runs with ours:

    python -m venv /tmp/av && /tmp/av/bin/pip install openai-agents
    /tmp/av/bin/python bench/agent_turn.py --server-python .venv/bin/python

The agent must call the tool (tool_choice "required") and finish the turn with its
result ("stop_on_first_tool"). Also run, and recorded as they come out: the SDK's
default behaviour, which sends the result back as a function_call_output item and
asks the model again (tool_choice reset to auto), until it answers in text or
max_turns (4) is reached. Writes results/agent_turn.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "smollm2"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_turn(url: str, streamed: bool, behaviour: str) -> dict:
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_api,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), use_for_tracing=False)
    set_default_openai_api("responses")  # the SDK's default, said out loud
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"22 C and sunny in {city}"

    agent = Agent(
        name="weather",
        model=MODEL,
        tools=[get_weather],
        tool_use_behavior=behaviour,
        instructions="Answer questions about the weather with the get_weather tool.",
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )
    t0 = time.perf_counter()
    out = {"streamed": streamed, "tool_use_behavior": behaviour}
    try:
        if streamed:
            run = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
            out["stream_events"] = len([e.type async for e in run.stream_events()])
            result = run
        else:
            result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    except MaxTurnsExceeded as e:  # the model kept calling the tool instead of answering
        out["error"] = f"{type(e).__name__}: {e}"
        result = e.run_data
    out.update(
        {
            "seconds": round(time.perf_counter() - t0, 2),
            "tool_called_with": calls,
            "items": [type(i).__name__ for i in result.new_items] if result else None,
            "model_calls": len(result.raw_responses) if result else None,
            "final_output": getattr(result, "final_output", None),
        }
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-python", default=sys.executable, help="the interpreter that has tokenmill")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(HERE / "results" / "agent_turn_server.log", "w")
    server = subprocess.Popen(
        [args.server_python, "-m", "tokenmill", "serve", "--port", str(port), "--served-model-name", MODEL],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        for _ in range(240):
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        import agents

        runs = [
            asyncio.run(one_turn(url, streamed, behaviour))
            for behaviour in ("stop_on_first_tool", "run_llm_again")
            for streamed in (False, True)
        ]
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    ok = all(
        r["tool_called_with"] and r["final_output"] and "ToolCallOutputItem" in r["items"]
        for r in runs
        if r["tool_use_behavior"] == "stop_on_first_tool"
    )
    result = {
        "command": " ".join(sys.argv),
        "openai_agents": agents.__version__,
        "machine": cpu_name(),
        "ok": ok,
        "runs": runs,
    }
    (HERE / "results" / "agent_turn.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

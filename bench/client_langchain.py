"""langchain-openai against a running `tokenmill serve`: the calls its users make
(invoke, stream, structured output, tools, the Responses API, embeddings), each
printed. langchain pins packages of its own, so it runs in a venv of its own:

    python -m venv /tmp/av && /tmp/av/bin/pip install langchain-openai
    .venv/bin/tokenmill serve --port 8124 --served-model-name smollm2 &
    /tmp/av/bin/python bench/client_langchain.py --base-url http://127.0.0.1:8124/v1
"""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8124/v1")
    p.add_argument("--model", default="smollm2")
    args = p.parse_args()
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings
    from pydantic import BaseModel

    common = dict(model=args.model, base_url=args.base_url, api_key="unused", temperature=0)
    llm = ChatOpenAI(**common, max_tokens=20)
    print("invoke:", llm.invoke("What is the capital of France?").content)
    print("stream:", "".join(c.content for c in llm.stream("Say hi")))

    class Person(BaseModel):
        name: str
        age: int

    print("structured:", llm.with_structured_output(Person).invoke("Make up a person."))

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    called = (
        ChatOpenAI(**common, max_tokens=60).bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
    )
    print("tools:", called.tool_calls, called.invalid_tool_calls)
    print("responses:", ChatOpenAI(**common, max_tokens=20, use_responses_api=True).invoke("Capital of Italy?").content)
    emb = OpenAIEmbeddings(model=args.model, base_url=args.base_url, api_key="unused", check_embedding_ctx_length=False)
    print("embeddings:", len(emb.embed_query("hello")), len(emb.embed_documents(["a", "b"])))


if __name__ == "__main__":
    main()

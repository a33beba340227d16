"""The Responses API's store: bounded in count and age, each response its key's alone."""

from __future__ import annotations

import time

from tokenmill.server.jobs.response_items import ResponseStore, owner_of
from tokenmill.server.protocol.responses_request import items_to_messages


def test_the_store_keeps_the_newest_for_their_owner_only():
    store = ResponseStore(size=3, ttl=60)
    alice, bob = owner_of("Bearer a"), owner_of("Bearer b")
    for i in range(5):
        store.put(alice, {"id": f"resp_{i}"}, [{"role": "user", "content": str(i)}])
    assert (
        len(store) == 3
        and store.get(alice, "resp_1") is None
        and store.get(alice, "resp_4").messages[0]["content"] == "4"
    )
    assert store.get(bob, "resp_4") is None and not store.delete(bob, "resp_4")  # another key sees nothing
    assert store.delete(alice, "resp_4") and store.get(alice, "resp_4") is None and len(store) == 2


def test_stored_responses_expire():
    store = ResponseStore(size=10, ttl=0.05)
    store.put("o", {"id": "resp_x"}, [])
    time.sleep(0.1)
    assert store.get("o", "resp_x") is None and len(store) == 0


def test_function_call_items_become_one_assistant_message_with_its_text():
    messages = items_to_messages(
        [
            {"role": "user", "content": "Weather in Rome and Oslo?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Rome"}'},
            {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "20 C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "5 C"}]},
        ]
    )
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Checking." and [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert (messages[3]["tool_call_id"], messages[3]["content"]) == ("c2", "5 C")

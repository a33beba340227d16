"""The web page in a real browser: the headless system Chromium, driven by Selenium,
against the session's `tokenmill serve --api-key` (tests/server/conftest.py).

One browser for the module; the tests share its cookie and the page's local storage,
and each opens the page it needs (``open_page`` signs in when asked). What changes
on the page is recorded in the page itself (``RECORDER``: a MutationObserver), so a
state that lasts a few milliseconds is seen as well as one that lasts seconds.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from tests.helpers import browser, chromium_paths, console_errors, set_viewport, wait_until
from tests.server.conftest import API_KEY, MODEL

pytest.importorskip("selenium", reason="pip install -e '.[test]' (selenium drives the browser tests)")
if chromium_paths() is None:
    pytest.skip(
        "no Chromium for the browser tests: apt-get install chromium chromium-driver (`make test` does it where apt "
        "is available), or set TOKENMILL_CHROMIUM and TOKENMILL_CHROMEDRIVER",
        allow_module_level=True,
    )

from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

DESKTOP = (1280, 860)
PHONE = (390, 844)
LONG_PROMPT = "Write a long story about a lighthouse keeper, with many details."  # greedy: 200 tokens and more
BLOCK_ATTRS = ("blocks", "free", "cached", "used", "shared", "hits")

# Records every data-state a message, a request row or the connection status takes, and
# every change of the block grid's counts: window.__seen, a list of [kind, key, value].
RECORDER = """
const seen = window.__seen = [];
const note = (el) => {
  if (!(el instanceof Element)) return;
  if (el.matches("li.msg")) {
    const all = [...document.querySelectorAll("li.msg")];
    seen.push(["msg", all.indexOf(el) + ":" + el.dataset.role, el.dataset.state]);
  } else if (el.matches("tr[data-request]")) {
    seen.push(["row", el.dataset.request, el.dataset.state]);
  } else if (el.id === "conn-status") {
    seen.push(["conn", "", el.dataset.state]);
  } else if (el.id === "block-grid") {
    seen.push(["blocks", "", Object.fromEntries(["blocks", "free", "cached", "used", "shared", "hits"].map((k) => [k, Number(el.dataset[k])]))]);
  }
};
const noteTree = (el) => {
  if (!(el instanceof Element)) return;
  note(el);
  el.querySelectorAll("li.msg, tr[data-request], #conn-status, #block-grid").forEach(note);
};
noteTree(document.body);
new MutationObserver((records) => {
  for (const r of records) {
    if (r.type === "attributes") note(r.target); else r.addedNodes.forEach(noteTree);
  }
}).observe(document.body, {subtree: true, childList: true, attributes: true,
  attributeFilter: ["data-state", "data-blocks", "data-free", "data-cached", "data-used", "data-shared", "data-hits"]});
"""


@pytest.fixture(scope="module")
def page():
    with browser(*DESKTOP) as driver:
        driver.set_page_load_timeout(30)
        yield driver


@pytest.fixture(autouse=True)
def no_console_errors(page):
    """No test leaves an error in the console (the login test takes its expected 401s)."""
    console_errors(page)  # what an earlier test left was reported there
    yield
    errors = console_errors(page)
    assert not errors, f"console errors: {errors}"


# ------------------------------------------------------------------------------ helpers


def css(driver, selector):
    return driver.find_elements(By.CSS_SELECTOR, selector)


def open_page(driver, server, view: str = "chat") -> None:
    """The page at #view, signed in (the key typed into the login form if it asks)."""
    driver.get(f"{server.url}/#{view}")
    if css(driver, "input[name=key]"):
        sign_in(driver, API_KEY)
        driver.get(f"{server.url}/#{view}")
        errors = [e for e in console_errors(driver) if "status of 401" not in e]  # (the browser reports the 401)
        assert not errors, f"console errors: {errors}"
    assert wait_until(lambda: driver.execute_script("return !!window.tokenmill"), timeout=10), "app.js did not start"
    assert not driver.find_element(By.ID, f"view-{view}").get_attribute("hidden")


def sign_in(driver, key: str) -> None:
    field = driver.find_element(By.CSS_SELECTOR, "form[action='/login'] input[name=key]")
    field.clear()
    field.send_keys(key)
    field.submit()


def record(driver) -> None:
    driver.execute_script(RECORDER)


def seen(driver, kind: str) -> list[tuple[str, object]]:
    return [(key, value) for k, key, value in driver.execute_script("return window.__seen") if k == kind]


def set_field(driver, element_id: str, value) -> None:
    """A form field's value, as typing it would leave it (input and change events)."""
    driver.execute_script(
        "const el = document.getElementById(arguments[0]); el.value = arguments[1];"
        "el.dispatchEvent(new Event('input', {bubbles: true})); el.dispatchEvent(new Event('change', {bubbles: true}));",
        element_id,
        str(value),
    )


def assistant_messages(driver):
    return css(driver, "#messages li.msg[data-role=assistant]")


def wait_answer_ends(driver, index: int, timeout: float = 60) -> str:
    """The final data-state of the index-th assistant message."""

    def ended():
        items = assistant_messages(driver)
        return len(items) > index and items[index].get_attribute("data-state") != "streaming"

    assert wait_until(ended, timeout=timeout, interval=0.05), f"answer {index} still streaming after {timeout} s"
    return assistant_messages(driver)[index].get_attribute("data-state")


def conn_state(driver) -> str:
    return driver.find_element(By.ID, "conn-status").get_attribute("data-state")


def block_counts(driver) -> dict[str, int]:
    data = driver.execute_script("return Object.assign({}, document.getElementById('block-grid').dataset)")
    return {k: int(data.get(k, -1)) for k in BLOCK_ATTRS}


def no_horizontal_scroll(driver) -> bool:
    return driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")


def stream_chat(server, prompt: str, max_tokens: int) -> None:
    """A streamed greedy chat that runs max_tokens tokens (no early end), read to the end."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            assert "data: [DONE]" in list(r.iter_lines())


# -------------------------------------------------------------------------------- tests


def test_the_page_asks_for_the_key(page, server):
    assert httpx.get(server.url + "/").status_code == 401
    page.delete_all_cookies()
    page.get(server.url + "/")
    assert css(page, "form[action='/login'] input[name=key]"), "no login form at / without the key"
    assert not css(page, "#tab-chat"), "the page shows before the key"

    sign_in(page, "not-the-key")
    assert wait_until(lambda: bool(css(page, ".error")), timeout=10), "a wrong key shows no error"
    assert css(page, "form[action='/login'] input[name=key]") and not css(page, "#tab-chat")

    sign_in(page, API_KEY)
    assert wait_until(lambda: bool(css(page, "#tab-chat")), timeout=10), "the right key does not open the page"
    assert page.find_element(By.ID, "sign-out").is_displayed()
    page.find_element(By.CSS_SELECTOR, "#sign-out button").click()  # and out again: the form is back
    assert wait_until(lambda: bool(css(page, "form[action='/login'] input[name=key]")), timeout=10)
    sign_in(page, API_KEY)
    assert wait_until(lambda: bool(css(page, "#tab-chat")), timeout=10)
    # the browser reports both 401 answers (the first visit, the wrong key); nothing else
    errors = [e for e in console_errors(page) if "status of 401" not in e]
    assert not errors, f"console errors: {errors}"


def test_a_chat_streams_an_answer(page, server, http):
    open_page(page, server, "chat")
    page.find_element(By.ID, "clear").click()
    for field, value in (("system", ""), ("temperature", 0), ("top-p", 1), ("max-tokens", 24), ("seed", "")):
        set_field(page, field, value)
    prompt = "What is the capital of France? Answer in one word."
    page.find_element(By.ID, "prompt").send_keys(prompt)
    record(page)
    page.find_element(By.ID, "send").click()

    assert wait_answer_ends(page, 0) == "done"
    states = [state for key, state in seen(page, "msg") if key.endswith(":assistant")]
    assert "streaming" in states and states[-1] == "done", states
    answer = assistant_messages(page)[0]
    content = answer.find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent")
    stats = answer.find_element(By.CSS_SELECTOR, ".stats").text
    assert content.strip(), "an empty answer"
    assert "tok" in stats and "TTFT" in stats, stats

    # greedy in float32: the page's streamed answer is the API's, token for token
    direct = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0},
    )
    assert direct.status_code == 200, direct.text
    assert content == direct.json()["choices"][0]["message"]["content"]


def request_rows(driver) -> dict[str, tuple[str, list[str]]]:
    """Each request row on the page: its state, and the states it says the request passed through."""
    rows = driver.execute_script(
        "return [...document.querySelectorAll('#requests tr[data-request]')]"
        ".map((tr) => [tr.dataset.request, tr.dataset.state, (tr.dataset.history || '').split(' ').filter(Boolean)])"
    )
    return {key: (state, history) for key, state, history in rows}


def test_the_live_view_shows_the_requests(page, server):
    open_page(page, server, "chat")
    page.find_element(By.ID, "tab-live").click()
    assert not page.find_element(By.ID, "view-live").get_attribute("hidden")
    assert wait_until(lambda: conn_state(page) == "open", timeout=10), conn_state(page)
    assert wait_until(lambda: block_counts(page)["blocks"] > 0, timeout=5), "the block grid has no data-blocks"
    before = block_counts(page)
    assert before["free"] + before["cached"] + before["used"] + before["shared"] == before["blocks"], before
    record(page)
    earlier = set(request_rows(page))

    def new_rows() -> dict[str, tuple[str, list[str]]]:
        return {key: row for key, row in request_rows(page).items() if key not in earlier}

    def running_rows() -> int:
        return page.execute_script("return document.querySelectorAll('#requests tr[data-state=running]').length")

    # A prompt of its own (its blocks are new to the cache) that runs until the page has seen
    # it running with its blocks in use, then is ended by closing its stream: long enough by
    # construction, whatever the machine's speed (its max_tokens alone would take seconds).
    prompt = f"[{uuid.uuid4()}] Tell me about the history of lighthouses, their keepers and their lamps."
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 6000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()  # (its stream is not read: it stays open until the `with` ends)
            assert wait_until(lambda: running_rows() == 1 and block_counts(page)["used"] > 0, timeout=30), (
                f"the running request's row or its blocks never showed: {new_rows()}; blocks {block_counts(page)}"
            )
    # then the same prompt again, a few tokens: a prefix-cache hit, and a request that may well
    # start and end between two of the stream's events
    stream_chat(server, prompt, max_tokens=4)

    def settled():  # the steps may arrive an event after the block counts
        counts = block_counts(page)
        finished = [key for key, (state, _) in new_rows().items() if state == "finished"]
        return counts["used"] == 0 and counts != before and len(finished) >= 2 and not running_rows()

    assert wait_until(settled, timeout=10, interval=0.1), (
        f"the two requests' rows did not both finish, or a row still runs: {new_rows()}; blocks {block_counts(page)}"
    )
    # each row says that its request ran, then finished: the short one too, though the page
    # may never have drawn it running
    assert [history for _, history in new_rows().values()] == [["running", "finished"]] * 2, new_rows()
    after = block_counts(page)
    counts = [c for _, c in seen(page, "blocks")]
    assert max(c["used"] for c in counts) > 0, "no block was in use while the requests ran"
    assert max(c["hits"] for c in counts) > 0, "the second request's prefix-cache hit did not show"
    assert (
        after["blocks"] == before["blocks"]
        and sum(after[k] for k in ("free", "cached", "used", "shared")) == after["blocks"]
    )
    # the finished requests' full blocks stay cached (unless no never-used block was left)
    assert after["cached"] > before["cached"] or after["free"] == 0, (before, after)
    assert int(page.find_element(By.ID, "gantt").get_attribute("data-steps") or 0) > 0
    assert css(page, "#gauges [data-gauge=running]")
    assert page.find_element(By.ID, "conn-status").get_attribute("data-state") == "open"


def test_a_phone_sized_window_does_not_scroll_sideways(page, server):
    open_page(page, server, "chat")
    viewport = page.execute_script("const m = document.querySelector('meta[name=viewport]'); return m && m.content")
    assert viewport and "width=device-width" in viewport, f"no phone viewport: {viewport}"
    set_viewport(page, *PHONE)  # (not as a phone: 390 CSS pixels wide whatever the meta says)
    try:
        for view in ("chat", "live"):
            open_page(page, server, view)
            if view == "live":
                assert wait_until(lambda: block_counts(page)["blocks"] > 0, timeout=10)
            time.sleep(0.3)  # a drawing frame
            width = page.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
            assert no_horizontal_scroll(page), f"#{view} at {PHONE}: scrollWidth {width[0]} > innerWidth {width[1]}"
    finally:
        set_viewport(page, *DESKTOP)


def test_the_chat_works_from_the_keyboard(page, server):
    open_page(page, server, "chat")
    page.find_element(By.ID, "clear").click()
    set_field(page, "temperature", 0)
    set_field(page, "max-tokens", 200)
    page.execute_script("document.activeElement && document.activeElement.blur(); document.body.focus()")
    for _ in range(40):
        if page.execute_script("return document.activeElement.id") == "prompt":
            break
        ActionChains(page).send_keys(Keys.TAB).perform()
    assert page.execute_script("return document.activeElement.id") == "prompt", "Tab never reaches #prompt"

    n = 0
    ActionChains(page).send_keys(LONG_PROMPT, Keys.ENTER).perform()
    assert wait_until(lambda: len(assistant_messages(page)) > n, timeout=5), "Enter in #prompt sends nothing"

    def streaming_text():
        item = assistant_messages(page)[n]
        return item.get_attribute("data-state") == "streaming" and item.find_element(By.CSS_SELECTOR, ".content").text

    assert wait_until(streaming_text, timeout=15, interval=0.05), "the answer never streamed"
    ActionChains(page).send_keys(Keys.ESCAPE).perform()
    assert wait_answer_ends(page, n, timeout=10) == "stopped"
    assert "stopped" in assistant_messages(page)[n].find_element(By.CSS_SELECTOR, ".stats").text
    assert page.find_element(By.ID, "send").is_enabled() and not page.find_element(By.ID, "stop").is_enabled()

    # and the Stop button does as Escape does (in a new conversation: the same long answer)
    page.find_element(By.ID, "clear").click()
    n = 0
    page.find_element(By.ID, "prompt").send_keys(LONG_PROMPT, Keys.ENTER)
    assert wait_until(lambda: len(assistant_messages(page)) > n, timeout=5)
    assert wait_until(streaming_text, timeout=15, interval=0.05), (
        f"the answer never streamed: {assistant_messages(page)[n].get_attribute('data-state')}, "
        f"{assistant_messages(page)[n].text!r}"
    )
    page.find_element(By.ID, "stop").click()
    assert wait_answer_ends(page, n, timeout=10) == "stopped"


def test_the_live_stream_reconnects(page, server):
    open_page(page, server, "live")
    assert wait_until(lambda: conn_state(page) == "open", timeout=10)
    record(page)
    page.execute_script("window.__old = window.tokenmill.liveSource; window.__old.close()")
    start = time.monotonic()
    assert wait_until(lambda: conn_state(page) != "open", timeout=5), "a closed stream goes unnoticed"
    assert wait_until(lambda: conn_state(page) == "open", timeout=10), f"no reconnection: {conn_state(page)}"
    assert time.monotonic() - start < 6
    assert page.execute_script(
        "return window.tokenmill.liveSource !== window.__old"
        " && window.tokenmill.liveSource.readyState === EventSource.OPEN"
    )
    states = [s for _, s in seen(page, "conn")]
    assert states[0] == "open" and states[-1] == "open" and len(states) >= 3, states


def test_a_json_schema_constrains_the_answer(page, server):
    """The schema pasted into the page is the request's response_format: the answer parses
    and has the schema's fields."""
    open_page(page, server, "chat")
    page.find_element(By.ID, "clear").click()
    set_field(page, "temperature", 0)
    set_field(page, "max-tokens", 40)
    schema = '{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}'
    page.find_element(By.ID, "structured-details").click()  # open it, as a user would
    set_field(page, "json-schema", schema)
    page.find_element(By.ID, "prompt").send_keys("Which city is the capital of France?", Keys.ENTER)
    assert wait_answer_ends(page, 0) == "done"
    content = assistant_messages(page)[0].find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent")
    assert isinstance(json.loads(content)["city"], str), content
    set_field(page, "json-schema", "{not json")
    page.find_element(By.ID, "prompt").send_keys("Again?", Keys.ENTER)
    error = page.find_element(By.ID, "settings-error")
    assert wait_until(error.is_displayed, timeout=5) and "JSON schema" in error.text
    assert len(assistant_messages(page)) == 1  # nothing was sent
    set_field(page, "json-schema", "")


def test_thousands_of_steps_keep_the_page_bounded(page, server):
    """5,000 steps of 4,000 requests, fed as the live stream's states: the page keeps 240
    steps and 200 requests, and still draws."""
    open_page(page, server, "live")
    assert wait_until(lambda: conn_state(page) == "open", timeout=10)
    page.execute_script("window.tokenmill.liveSource.close()")  # only the fed states from here on
    kept = page.execute_script("""
        const model = (steps) => ({name: "fed", alive: true, traced: true, max_model_len: 512, blocks: "0123".repeat(64),
          gauges: {running: 2, waiting: 1, kv_usage: 0.5, preemptions: 0, prefix_cache_hit_rate: null,
                   spec_acceptance: null, generation_tokens_per_s: 1, prompt_tokens_per_s: 1},
          latency_ms: {ttft: null, itl: null}, finished: {}, adapters: null, series: [], last_step: 0, steps});
        let n = 0;
        for (let batch = 0; batch < 50; batch++) {
          const steps = [];
          for (let i = 0; i < 100; i++) {
            n += 1;
            steps.push({step: n, time: -0.1, duration: 0.01, running: 2, waiting: 1, blocks_used: 1, blocks_cached: 0,
                        preempted: [], ended: [], seqs: [["r" + Math.floor(n * 0.8), "decode", 1, 0, 0, 0, null, null]]});
          }
          window.tokenmill.onState({epoch: "fed-epoch", series_bucket_s: 0.5, models: [model(steps)]});
        }
        return window.tokenmill.kept();
    """)
    assert kept == [{"name": "fed", "steps": 240, "requests": 200}], kept
    time.sleep(0.3)  # a drawing frame
    assert int(page.find_element(By.ID, "gantt").get_attribute("data-steps")) > 0
    page.execute_script("window.tokenmill.reconnect()")  # back to the server's own stream
    assert wait_until(lambda: conn_state(page) == "open", timeout=10)


def test_a_request_that_ran_between_two_events_still_shows_it_ran(page, server):
    """One event of the live stream carries every step since the last, so a request that
    started and ended between two (a short one, or any on a fast machine) is drawn only
    finished: its row still carries the states it passed through. Fed as the stream's
    states, so that the steps fall between two events whatever the machine's speed."""
    open_page(page, server, "live")
    assert wait_until(lambda: conn_state(page) == "open", timeout=10)
    page.execute_script("window.tokenmill.liveSource.close()")  # only the fed state from here on
    page.execute_script("""
        const seq = (label, kind, tokens, finish) => [label, kind, tokens, 0, 0, 0, null, finish];
        const step = (n, seqs, preempted = [], ended = []) => ({step: n, time: -0.1, duration: 0.01, running: 1,
          waiting: 0, blocks_used: 1, blocks_cached: 0, seqs, preempted, ended});
        const steps = [
          step(1, [seq("r1", "prefill", 12, null)]),
          step(2, [seq("r1", "decode", 1, null), seq("r2", "prefill", 8, null)]),
          step(3, [seq("r1", "decode", 1, "length")], ["r2"]),  // r2 preempted
          step(4, [seq("r2", "prefill", 9, null)]),
          step(5, [seq("r2", "decode", 1, "stop")]),
          step(6, [], [], [["r3", "abort"]]),  // r3 ended before it ever ran
        ];
        window.tokenmill.onState({epoch: "fed-epoch", series_bucket_s: 0.5, models: [{
          name: "fed", alive: true, traced: true, max_model_len: 512, blocks: "0000",
          gauges: {running: 0, waiting: 0, kv_usage: 0, preemptions: 1, prefix_cache_hit_rate: null,
                   spec_acceptance: null, generation_tokens_per_s: 1, prompt_tokens_per_s: 1},
          latency_ms: {ttft: null, itl: null}, finished: {}, adapters: null, series: [], last_step: 6, steps}]});
    """)
    expected = {
        "r1": ("finished", ["running", "finished"]),
        "r2": ("finished", ["running", "preempted", "running", "finished"]),
        "r3": ("finished", ["finished"]),
    }
    assert wait_until(lambda: request_rows(page) == expected, timeout=5), request_rows(page)

    def r2_title() -> str | None:  # one script: the table is redrawn meanwhile, a row found in one call may be gone
        return page.execute_script("return document.querySelector('#requests tr[data-request=r2]')?.title")

    assert wait_until(lambda: r2_title() == "running → preempted → running → finished", timeout=5), r2_title()
    page.execute_script("window.tokenmill.reconnect()")  # back to the server's own stream
    assert wait_until(lambda: conn_state(page) == "open", timeout=10)

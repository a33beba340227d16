"""The web page's screenshots for the docs: the chat and the live view, on a desktop and a phone.

    python docs/screenshots.py [--out docs/] [-- SERVE FLAGS...]

Starts `tokenmill serve` on the default model (or on what the flags after ``--`` say),
has one finished exchange in the chat (with a system prompt), keeps a few streamed
chats running at once so the live view is busy, and saves

    web-chat-desktop.png   web-chat-phone.png   web-live-desktop.png   web-live-phone.png

Needs the system Chromium and its driver (apt-get install chromium chromium-driver; or
$TOKENMILL_CHROMIUM and $TOKENMILL_CHROMEDRIVER) and selenium (pip install -e '.[test]').
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from tokenmill.loadgen.server_process import free_port

DESKTOP = (1280, 860)
PHONE = (390, 844)
PHONE_MAX_HEIGHT = 2400  # a phone shot is the whole page, up to this
SYSTEM = "You are a concise assistant. Answer in two or three sentences."
QUESTION = "What does a KV cache do in an LLM inference server?"
BUSY_PROMPTS = [
    "Write a short story about a lighthouse keeper and a storm.",
    "Explain how continuous batching works, step by step.",
    "List ten facts about the Moon, one a line.",
    "Describe a walk through a rainy city at night.",
    "Explain paged attention to a new engineer.",
    "Write a poem about tokens flowing through a mill.",
]


def chromium_paths() -> tuple[str, str]:
    browser = os.environ.get("TOKENMILL_CHROMIUM") or next(
        filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
    )
    driver = os.environ.get("TOKENMILL_CHROMEDRIVER") or shutil.which("chromedriver")
    if not (browser and driver):
        sys.exit(
            "no Chromium: apt-get install chromium chromium-driver (or set TOKENMILL_CHROMIUM, TOKENMILL_CHROMEDRIVER)"
        )
    return browser, driver


@contextmanager
def chromium():
    """A headless Chromium; its driver given by path, so Selenium Manager downloads nothing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        sys.exit("no selenium: pip install -e '.[test]'")
    browser, driver_path = chromium_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--hide-scrollbars",
                "--window-size=1280,860"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def viewport(driver, width: int, height: int, mobile: bool) -> None:
    """Exactly width x height CSS pixels (a headless window is at least 500 wide)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})  # fmt: skip


def wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def shoot(driver, path: Path, size: tuple[int, int], phone: bool) -> None:
    width, height = size
    viewport(driver, width, height, mobile=phone)
    time.sleep(0.5)  # layout, and a frame of the live view's canvases
    if phone:  # the whole page, as one tall phone screen
        full = driver.execute_script("return document.documentElement.scrollHeight")
        viewport(driver, width, min(max(height, full), PHONE_MAX_HEIGHT), mobile=True)
        time.sleep(0.7)
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(path))
    print(f"wrote {path}")


def set_field(driver, element_id: str, value) -> None:
    driver.execute_script(
        "const el = document.getElementById(arguments[0]); el.value = arguments[1];"
        "el.dispatchEvent(new Event('input', {bubbles: true})); el.dispatchEvent(new Event('change', {bubbles: true}));",
        element_id,
        str(value),
    )


@contextmanager
def server(flags: list[str]):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"tokenmill-screenshots-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited ({proc.returncode}); see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"tokenmill serve did not come up; see {log.name}")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class Traffic:
    """A few streamed chats at once, again and again, until stopped (each stopped mid-answer)."""

    def __init__(self, url: str, model: str, streams: int = 4) -> None:
        self.url, self.model, self.stop_event = url, model, threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(streams)]

    def run(self, i: int) -> None:
        n = i
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop_event.is_set():
                body = {"model": self.model, "stream": True, "max_tokens": 96 + 48 * (n % 4), "temperature": 0.8,
                        "messages": [{"role": "user", "content": BUSY_PROMPTS[n % len(BUSY_PROMPTS)]}]}  # fmt: skip
                n += len(self.threads)
                try:
                    with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        for _ in r.iter_lines():
                            if self.stop_event.is_set():
                                break
                except httpx.HTTPError:
                    time.sleep(0.5)

    def __enter__(self) -> Traffic:
        for i, t in enumerate(self.threads):
            t.start()
            time.sleep(0.4 * (i > 0))  # staggered: the requests start and end at different steps
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="where the PNGs go (docs/)")
    parser.add_argument("--busy-seconds", type=float, default=8.0, help="traffic before the live view's shots")
    parser.add_argument("serve_flags", nargs="*", help="after --: flags for tokenmill serve")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from selenium.webdriver.common.by import By

    with server(args.serve_flags) as url, chromium() as driver:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        viewport(driver, *DESKTOP, mobile=False)
        driver.get(url + "/#chat")
        wait(lambda: driver.execute_script("return !!window.tokenmill && document.getElementById('model').value"),
             20, "the page")  # fmt: skip
        driver.find_element(By.ID, "clear").click()
        set_field(driver, "system", SYSTEM)
        set_field(driver, "temperature", 0)
        set_field(driver, "max-tokens", 120)
        driver.find_element(By.ID, "prompt").send_keys(QUESTION)
        driver.find_element(By.ID, "send").click()
        done = "return [...document.querySelectorAll('li.msg[data-role=assistant]')].every(li => li.dataset.state !== 'streaming')"
        wait(lambda: driver.find_elements(By.CSS_SELECTOR, "li.msg[data-role=assistant]"), 10, "the answer")
        wait(lambda: driver.execute_script(done), 180, "the answer to finish")
        driver.execute_script("document.activeElement.blur()")
        shoot(driver, args.out / "web-chat-desktop.png", DESKTOP, phone=False)
        driver.refresh()  # (the conversation and the system prompt stay in local storage)
        wait(lambda: driver.execute_script("return !!window.tokenmill"), 20, "the page")
        shoot(driver, args.out / "web-chat-phone.png", PHONE, phone=True)

        with Traffic(url, model):
            viewport(driver, *DESKTOP, mobile=False)
            driver.get(url + "/#live")
            time.sleep(args.busy_seconds)
            shoot(driver, args.out / "web-live-desktop.png", DESKTOP, phone=False)
            shoot(driver, args.out / "web-live-phone.png", PHONE, phone=True)
    print(f"screenshots in {args.out}")


if __name__ == "__main__":
    main()

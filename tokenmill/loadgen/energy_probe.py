"""Energy and cost of one `bench serve` run: the server's own joules where it exports them
(tokenmill's ``tokenmill:energy_joules_total``, labelled measured or estimated), else this
machine's (RAPL where readable, else an estimate from the whole machine's busy CPU seconds:
right when the server runs here and nothing else does, labelled so); and the run's price at
``--price-per-hour``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenmill.host.energy import ESTIMATED, EnergyMeter, dollars_per_million, joules_per_token, machine_cpu_seconds

_SERVER_JOULES = re.compile(r'^tokenmill:energy_joules_total\{source="(\w+)"\} (\S+)$', re.M)


def server_joules(base_url: str, api_key: str | None) -> tuple[float, str] | None:
    """The server's joules and their source from its /metrics; None where it exports none."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    found = _SERVER_JOULES.findall(r.text) if r.status_code == 200 else []
    return (sum(float(j) for _, j in found), found[0][0]) if found else None


@dataclass
class EnergyProbe:
    """Reads joules before and after each run, from the server or from this machine."""

    base_url: str
    api_key: str | None
    watts_per_cpu: float | None = None

    def __post_init__(self) -> None:
        self.from_server = server_joules(self.base_url, self.api_key) is not None
        self.local = None if self.from_server else EnergyMeter(self.watts_per_cpu, cpu_seconds=machine_cpu_seconds)

    def read(self) -> tuple[float, str, str]:
        """(joules, source, how) now; differences of two readings are a run's."""
        if self.local is not None:
            r = self.local.read()
            how = r.how.split(" x ")[0] + " (whole machine)" if r.source == ESTIMATED else r.how
            return r.joules, r.source, how
        got = server_joules(self.base_url, self.api_key)
        if got is None:
            raise RuntimeError(f"{self.base_url}/metrics stopped exporting tokenmill:energy_joules_total")
        return got[0], got[1], "the server's /metrics"


def run_energy(
    before: tuple[float, str, str],
    after: tuple[float, str, str],
    summary: dict,
    prompt_tokens: int,
    price_per_hour: float | None,
) -> dict:
    """A run's energy and cost figures, from two readings and its summary."""
    joules = after[0] - before[0]
    out_tokens = round(summary["output_token_throughput"] * summary["duration_s"])
    energy = {
        "joules": round(joules, 2),
        "source": after[1],
        "how": after[2],
        "watts": round(joules / summary["duration_s"], 2) if summary["duration_s"] > 0 else None,
        "joules_per_output_token": joules_per_token(joules, out_tokens),
        "joules_per_request": joules / summary["completed"] if summary["completed"] else None,
    }
    cost = None
    if price_per_hour is not None:
        seconds = summary["duration_s"]
        cost = {
            "price_per_hour": price_per_hour,
            "dollars_per_million_output_tokens": dollars_per_million(price_per_hour, seconds, out_tokens),
            "dollars_per_million_tokens": dollars_per_million(price_per_hour, seconds, out_tokens + prompt_tokens),
        }
    return {"energy": energy, "cost": cost}

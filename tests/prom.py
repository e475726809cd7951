"""Reading the server's Prometheus /metrics in tests: ``await scrape(jp_fetch)``, ``value(...)``."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


async def scrape(jp_fetch) -> dict[tuple[str, tuple], float]:
    """The ``evalsched_`` samples of ``GET /metrics``: {(name, sorted labels): value}."""
    resp = await jp_fetch("metrics", method="GET")
    assert resp.code == 200
    out = {}
    for family in text_string_to_metric_families(resp.body.decode()):
        for sample in family.samples:
            if sample.name.startswith("evalsched_"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples, name, **labels) -> float:
    """A sample's value (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)

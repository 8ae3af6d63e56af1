"""Tier-aware routing end to end (docs/design.md §9.9, §13): 2 real tiny workers whose device
pools hold a few prefixes while their host tiers hold them all, so revisited prefixes come back
from the host (or are repaired, or recomputed: whichever `choose_reuse` prices cheapest). For
every sequential request, the router's prediction equals what the serving worker reports: cached
tokens (`usage`), loaded and repaired tokens (headers)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from tests.serve_process import serve

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

# The tiny model: window 32, 4 SWA layers (R = 128), 1 KiB of full and 4 KiB of SWA KV per token
# in float32. 2048 device tokens hold about six 300-token heads; 64 MiB of host tier all 16. A
# slow prefill (1 TFLOP/s) and a fast link make a load cheaper than recomputing any prefix.
CONFIG = """\
model: tiny
page_size: 16
max_total_tokens: 2048
swa_full_tokens_ratio: 0.125
host_kv_bytes: 67108864
prefill_tflops: 1.0
host_link_gbps: 1000
chunked_prefill_size: 512
workers: 2
worker_num_cpus: 0.5
"""


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("tier_serve"), CONFIG) as srv:
        yield srv.url


def test_predictions_equal_cached_loaded_and_repaired_tokens(url: str) -> None:
    """16 heads of 300 tokens, each sent with a fresh tail, then revisited twice after the
    others pushed it off the device: every response's predicted cached / loaded / repaired
    tokens equal the reported ones, and prefixes do come back from the host."""
    rng = random.Random(17)
    heads = [[rng.randrange(5, 1000) for _ in range(300)] for _ in range(16)]
    prompts = [h + [rng.randrange(5, 1000) for _ in range(12 + r)] for r in range(3) for h in heads]
    seen = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for prompt in prompts:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            h = r.headers
            served = (
                r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
                int(h["x-swaserve-loaded-tokens"]),
                int(h["x-swaserve-repaired-tokens"]),
            )
            predicted = tuple(int(h[f"x-swaserve-predicted-{k}-tokens"]) for k in ("cached", "loaded", "repaired"))
            assert predicted == served, (len(seen), h.get("x-swaserve-replica"))
            seen.append(served)
        metrics = http.get("/metrics").text
    loads = [loaded for _, loaded, _ in seen if loaded]
    assert len(loads) >= 3, seen
    assert "swaserve_loaded_prompt_tokens_total" in metrics and "swaserve_host_kv_used_tokens" in metrics

"""Repair-aware routing end to end (docs/design.md §9.8, §13.3): 2 real tiny workers whose SWA
pools are far smaller than the prefixes they cache, so revisited prefixes come back as
tombstones and are repaired. For every sequential request, the router's prediction equals what
the serving worker reports: cached tokens (`usage`) and repaired tokens (header)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from tests.serve_process import serve

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

# The tiny model: window 32, 4 SWA layers, so R = ceil16(32 + 3 * 32) = 128 and a repair needs
# a tombstoned stretch of >= 256 tokens. 256 SWA tokens per worker hold about 8 window tails.
CONFIG = """\
model: tiny
page_size: 16
max_total_tokens: 8192
swa_full_tokens_ratio: 0.03125
chunked_prefill_size: 512
workers: 2
worker_num_cpus: 0.5
"""


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("repair_serve"), CONFIG) as srv:
        yield srv.url


def test_predictions_equal_cached_and_repaired_tokens(url: str) -> None:
    """16 heads of 300 tokens, each sent with a fresh tail, then revisited twice: every
    response's predicted cached / repaired tokens equal the reported ones, and repairs happen."""
    rng = random.Random(13)
    heads = [[rng.randrange(5, 1000) for _ in range(300)] for _ in range(16)]
    prompts = [h + [rng.randrange(5, 1000) for _ in range(12 + r)] for r in range(3) for h in heads]
    seen = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for prompt in prompts:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            repaired = int(r.headers["x-swaserve-repaired-tokens"])
            predicted = (
                int(r.headers["x-swaserve-predicted-cached-tokens"]),
                int(r.headers["x-swaserve-predicted-repaired-tokens"]),
            )
            assert predicted == (cached, repaired), (len(seen), r.headers.get("x-swaserve-replica"))
            seen.append((cached, repaired))
        metrics = http.get("/metrics").text
    repairs = [c for c, rep in seen if rep]
    assert len(repairs) >= 3 and all(rep == 128 for _, rep in seen if rep), seen
    assert "swaserve_repaired_prompt_tokens_total" in metrics

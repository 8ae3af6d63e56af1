"""Counter-based sampling noise: the exponential draws of the sampler as a pure function of
(request key, step, token id), vectorised over the whole batch (docs/design.md §4.1).

Why not one `torch.Generator` per request: the CPU generator (mt19937) keeps only the low 32
bits of its seed, so seeds 1, 2**32 + 1 and 2**63 + 1 drew identical samples, and seeds
>= 2**64 did not fit at all. Here any integer seed is hashed (blake2b) into a 64-bit key, and
each draw hashes (key, step, token) with the splitmix64 finalizer in int64 arithmetic (torch's
int64 multiply wraps, on CPU and CUDA alike), so the same seed gives the same tokens on any
device, in any batch, and after a retraction (the step counter is the output position).
"""

from __future__ import annotations

import hashlib
import secrets

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_UNIFORM_BITS = 24  # float32 holds 24 bits exactly
_BELOW_ONE = 1.0 - 2.0**-24  # float32's largest value below 1


def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def seed_key(seed: int | None) -> int:
    """A request's 64-bit noise key (signed int64): a hash of its seed, or random without one."""
    if seed is None:
        return _signed(secrets.randbits(64))
    raw = seed.to_bytes((seed.bit_length() + 8) // 8 + 1, "little", signed=True)
    return _signed(int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little"))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    # Logical right shift of int64 (torch's >> is arithmetic on signed integers).
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _signed(_M1)
    x = (x ^ _shr(x, 27)) * _signed(_M2)
    return x ^ _shr(x, 31)


def exponential_noise(keys: list[int], steps: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """``E ~ Exp(1)``, float32 ``[len(keys), vocab]``: row i is a function of (keys[i], steps[i])."""
    k = torch.tensor(keys, dtype=torch.int64, device=device)
    s = torch.tensor(steps, dtype=torch.int64, device=device)
    row = _mix(k ^ _mix(s + _signed(_GOLDEN)))
    col = torch.arange(vocab, dtype=torch.int64, device=device) * _signed(_GOLDEN)
    bits = _shr(_mix(row[:, None] + col[None, :]), 64 - _UNIFORM_BITS)
    # NOTE: bits + 0.5 is not exact in float32 above 2**23: the top draw rounds up to 2**24, a
    # uniform of exactly 1.0 and E = -0.0, and then p / E is NaN for every token of probability 0
    # (masked by a grammar, dropped by top-k/top-p) and argmax picks the NaN. The clamp keeps
    # every uniform strictly inside (0, 1), so E > 0 (docs/design.md §4.1).
    uniform = ((bits.to(torch.float32) + 0.5) / float(1 << _UNIFORM_BITS)).clamp_(max=_BELOW_ONE)
    return -torch.log(uniform)

"""Every divisor of a count, in milliseconds whatever its size.

What this file teaches: the planner draws each mesh degree from the divisors of what it
must divide (the global batch, the GPUs left, the sequence), and FP8's blockwise recipe
names the block sizes that divide every width it tiles. Trying k = 1, 2, 3, ... up to
sqrt(n) is fine for 1024 and hopeless for a batch of 10^21 (3 10^10 tries). Factoring
first is not: small primes by trial, the rest by Pollard's rho (Brent's variant) with a
Miller-Rabin primality test, deterministic for every n below 3.3 10^24 with the first 13
primes as bases. The divisors are then the products of the prime powers.
"""

from __future__ import annotations

import math
from functools import lru_cache

SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Miller-Rabin with the first 13 primes as bases (exact below 3.3e24)."""
    if n < 2:
        return False
    for p in SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in SMALL_PRIMES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _rho(n: int) -> int:
    """A factor of the odd composite `n` (neither 1 nor n), by Brent's rho."""
    for c in range(1, n):
        y, m, g, r, q = 2, 128, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(m, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += m
            r *= 2
        if g == n:   # the batch overshot: step one at a time from the last saved point
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise ValueError(f"no factor of {n} found")   # not reached for a composite n


def factorize(n: int) -> dict[int, int]:
    """{prime: exponent} of the positive integer `n`."""
    out: dict[int, int] = {}
    for p in range(2, 1000):
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
        if p * p > n:
            break
    pending = [n] if n > 1 else []
    while pending:
        m = pending.pop()
        if is_prime(m):
            out[m] = out.get(m, 0) + 1
        else:
            f = _rho(m)
            pending += [f, m // f]
    return dict(sorted(out.items()))


@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """Every k that divides the positive integer `n`, smallest first."""
    out = [1]
    for p, e in factorize(n).items():
        out = [d * p ** i for d in out for i in range(e + 1)]
    return tuple(sorted(out))

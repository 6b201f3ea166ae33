# SPDX-License-Identifier: Apache-2.0
"""Decode points of the planner's calibration (pd_calibrate.py's (b), serve_predict.py's profile): B
streamed requests, and the token gaps while all B decode together = the decode instance's iteration
time at batch B and that context. Through a P/D front (the router), P prefills the B prompts one after
another, so their first tokens can come further apart than a short decode lasts (float32 on one AVX2
core: 2-3 s per 512-token prompt against ~2 s for 24 tokens): such a point is tried once more with
enough tokens to span that spread, where the model's length allows it."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

from pd_common import log, prompt, stream

JITTER_QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)


def steady_gaps(abs_times: list[list[float]], context: int) -> tuple[list[float], list[int]]:
    """The gaps (and their context lengths) after the last first token and before the first last token."""
    lo, hi = max(ts[0] for ts in abs_times), min(ts[-1] for ts in abs_times)
    gaps, ctx = [], []
    for ts in abs_times:
        for k, (a, b) in enumerate(zip(ts, ts[1:]), start=1):
            if a >= lo and b <= hi:
                gaps.append(b - a)
                ctx.append(context + k)
    return gaps, ctx


def tokens_to_overlap(abs_times: list[list[float]], tokens: int, batch: int) -> int:
    """Output tokens that keep the earliest request decoding past the last first token for ~3 B gaps
    (the steady window's minimum), from this try's own spread and median gap."""
    every = [b - a for ts in abs_times for a, b in zip(ts, ts[1:])]
    if not every:
        return tokens
    spread = max(ts[0] for ts in abs_times) - min(ts[0] for ts in abs_times)
    return tokens + math.ceil(spread / statistics.median(every)) + 3 * batch


async def decode_point(session, url: str, batch: int, context: int, tokens: int, seed: int,
                       max_tokens: int | None = None) -> dict | None:
    """B concurrent requests of `context` tokens through `url`; None when no steady window was seen."""
    rng = random.Random(seed)
    tokens = min(tokens, max_tokens) if max_tokens is not None else tokens
    if tokens < 1:
        raise ValueError(f"decode B={batch} ctx={context}: no room for an output token (max_tokens {max_tokens})")
    for again in (False, True):
        outs = await asyncio.gather(*(stream(session, url, {"prompt": prompt(context, rng), "max_tokens": tokens})
                                      for _ in range(batch)))
        abs_times = [[o["t0"] + t for t in o["times"]] for o in outs]
        gaps, ctx = steady_gaps(abs_times, context)
        if len(gaps) >= batch * 3:
            median = statistics.median(gaps)
            return {"batch_size": batch, "context_tokens": round(statistics.mean(ctx)), "output_tokens": tokens,
                    "ms": 1e3 * median, "num_gaps": len(gaps), "gap_ratios": [round(g / median, 4) for g in gaps]}
        longer = min(tokens_to_overlap(abs_times, tokens, batch), max_tokens or tokens)
        if again or longer <= tokens:
            break
        log(f"decode B={batch} ctx={context}: only {len(gaps)} steady gaps in {tokens} tokens, again with {longer}")
        tokens = longer
    log(f"decode B={batch} ctx={context}: only {len(gaps)} steady gaps, skipped")
    return None


async def decode_points(session, url: str, batches: list[int], contexts: list[int], tokens: int,
                        reps: int, max_model_len: int | None = None) -> list[dict]:
    """Every (batch, context) point `reps` times in interleaved rounds; the median round counts (a
    burst of other tenants' load spoils one round, not the point)."""
    runs: dict[tuple[int, int], dict[int, dict]] = {}  # point -> round -> row
    for r in range(reps):
        for c in contexts:
            for b in batches:
                room = max_model_len - c - 1 if max_model_len else None
                row = await decode_point(session, url, b, c, tokens, seed=b * 10_000 + c + r, max_tokens=room)
                if row:
                    runs.setdefault((b, c), {})[r] = row
    rows = []
    for by_round in runs.values():
        rounds = list(by_round.values())
        mid = sorted(rounds, key=lambda x: x["ms"])[len(rounds) // 2]
        rows.append({**mid, "rounds_ms": [x["ms"] for x in rounds],
                     "gap_ratios": [x["gap_ratios"] for x in rounds]})  # a list per round
        log(f"decode { {k: v for k, v in rows[-1].items() if k != 'gap_ratios'} }")
    return rows


def step_jitter(decode_rows: list[dict]) -> dict:
    """A profile's `step_jitter`: quantiles of every steady token gap over its point's median (the raw
    ratios are taken out of the rows). The planner's curves are medians; this is the spread, and it is
    the long-run spread, so every round's gaps are pooled (`decode_points` rows hold one list per
    round). Stop 49 tried both narrower estimates: the median round's gaps alone let one stall of
    ~15 gaps set plain's P99 ratio to 4.0 (TBT P99 predicted 3.4x the measured), and each quantile's
    median over rounds dropped the stalls that a served trace does meet (ours' P99 ratio 1.13, its
    TBT P99 at 0.15 req/s predicted 29 % short)."""
    return spread([r for row in decode_rows for round_ratios in row.pop("gap_ratios", []) for r in round_ratios])


def spread(ratios: list[float]) -> dict:
    """A profile's spread section (`step_jitter`, and `decode_while_prefilling`'s): the ratios'
    quantiles, or nothing from fewer than 50."""
    import numpy as np

    if len(ratios) < 50:
        return {}
    return {"quantiles": list(JITTER_QUANTILES),
            "ratios": [round(float(x), 4) for x in np.quantile(ratios, JITTER_QUANTILES)],
            "num_gaps": len(ratios)}


def _nearest_gap(ts: list[float], t: float) -> int | None:
    """The gap of one running request that a first token at `t` came out of: the one ending nearest `t`,
    if `t` is inside it or within half a gap after its end (the token may reach the client a little later)."""
    k = min(range(len(ts) - 1), key=lambda j: abs(ts[j + 1] - t))
    a, b = ts[k], ts[k + 1]
    return k if a < t < b + 0.5 * (b - a) else None


def join_extra_ms(background: list[list[float]], t_send: float, t_first: float) -> float | None:
    """What the step that took in one new request cost over a steady step, from the running requests'
    absolute token times: the new request's first token comes out of the step in which its pushed KV
    joined D's batch, so each running request's gap ending nearest that token is the join step; the
    gaps after every first token and before the new request was sent are the steady ones."""
    lo = max(ts[0] for ts in background)
    steady = [b - a for ts in background for a, b in zip(ts, ts[1:]) if lo <= a and b <= t_send]
    nearest = [(ts, _nearest_gap(ts, t_first)) for ts in background if len(ts) > 1]
    joined = [ts[k + 1] - ts[k] for ts, k in nearest if k is not None]
    if len(steady) < 3 * len(background) or not joined:
        return None
    return 1e3 * (statistics.median(joined) - statistics.median(steady))


async def running_stream(session, url: str, body: dict, first: asyncio.Future, times: list[float]) -> None:
    """One running request through `url`: each token's absolute time appended to `times` (kept when the
    task is cancelled), `first` resolved at its first token, or when it ends without one (a request
    that failed before its first token must not hold a wait on `first`)."""
    def on_token() -> None:
        times.append(time.perf_counter())
        first.done() or first.set_result(None)
    try:
        await stream(session, url, body, on_token=on_token)
    finally:
        first.done() or first.set_result(None)


async def join_point(session, url: str, batch: int, context: int, new_tokens: int, seed: int,
                     max_tokens: int = 200) -> float | None:
    """B requests decoding through `url`, then one more of `new_tokens` prompt tokens sent through the
    same front: the extra ms of the step it joined in (`join_extra_ms`), None when the running
    requests ended before it joined."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    started = [loop.create_future() for _ in range(batch)]
    background: list[list[float]] = [[] for _ in range(batch)]
    tasks = [asyncio.create_task(running_stream(session, url, {"prompt": prompt(context, rng), "max_tokens": max_tokens},
                                           first, times)) for first, times in zip(started, background)]
    await asyncio.wait_for(asyncio.gather(*started), timeout=600)
    await asyncio.sleep(0.5)  # steady gaps before the new request
    t_send = time.perf_counter()
    new = await stream(session, url, {"prompt": prompt(new_tokens, rng), "max_tokens": 2})
    await asyncio.gather(*tasks)
    return join_extra_ms(background, t_send, new["t0"] + new["times"][0])


async def join_cost(session, url: str, batch: int, context: int, prompt_sizes: list[int], reps: int) -> dict:
    """The profile's `decode_join`: the median extra ms of D's step in which a pushed request joins its
    running batch (vLLM computes the prompt's last token there, over the whole context, beside the
    batch's decode tokens). The decode points never see it: their requests join before the steady
    window. Per join of one request; every try is kept."""
    tries = []
    for r in range(reps):
        for n in prompt_sizes:
            extra = await join_point(session, url, batch, context, n, seed=77_000 + 100 * r + n)
            if extra is None:
                log(f"decode join B={batch} ctx={context} +{n}: the batch ended before the request joined, skipped")
                continue
            tries.append({"prompt_tokens": n, "ms": round(extra, 3)})
    if not tries:
        return {}
    return {"ms": max(0.0, statistics.median(t["ms"] for t in tries)), "batch_size": batch,
            "context_tokens": context, "tries": tries}


def interference_ratio(background: list[list[float]], windows: list[tuple[str, float, float]],
                       joins: list[float], settle_s: float = 0.2) -> dict | None:
    """D's step time while P prefills over its step time while P idles, from the running requests'
    absolute token times: each busy window's median gap over the mean of its two idle neighbours'
    (context grows through the run, so neighbours and not the whole run), the median over busy
    windows. A gap holding a probe's first token is its join step (`decode_join` costs it) and does
    not count; nor does a window with fewer than 3 gaps per running request."""
    joined = {(i, _nearest_gap(ts, t)) for t in joins for i, ts in enumerate(background) if len(ts) > 1}

    def window_gaps(t0: float, t1: float) -> list[float]:
        return [b - a for i, ts in enumerate(background) for k, (a, b) in enumerate(zip(ts, ts[1:]))
                if t0 + settle_s <= a and b <= t1 and (i, k) not in joined]

    gaps = [window_gaps(t0, t1) for _, t0, t1 in windows]
    medians = [statistics.median(g) if len(g) >= 3 * len(background) else None for g in gaps]
    ratios, gap_ratios = [], []
    for k in range(1, len(windows) - 1):
        before, busy, after = medians[k - 1], medians[k], medians[k + 1]
        if windows[k][0] == "busy" and None not in (before, busy, after):
            ratios.append(busy / (0.5 * (before + after)))
            gap_ratios += [g / (0.5 * (before + after)) for g in gaps[k]]
    if not ratios:
        return None
    return {"ratio": round(statistics.median(ratios), 4), "ratios": [round(r, 4) for r in ratios],
            "window_ms": [None if m is None else round(1e3 * m, 2) for m in medians],
            "num_gaps": [len(g) for g in gaps], **_busy_spread(gap_ratios)}


def _busy_spread(gap_ratios: list[float]) -> dict:
    """The spread of D's steps beside P's prompt steps, as `step_jitter` is of idle ones: every busy
    gap over its idle neighbours' median. The ratio alone moves the median; the tail moves more (stop 52:
    P99 1.44-1.77 beside a prefill, 1.36-1.37 idle; the cause is not measured), and the served TBT P99 is
    that tail."""
    out = spread(gap_ratios)
    return {"step_jitter": out} if out else {}


async def prefill_interference(session, url: str, batch: int, context: int, prompt_tokens: int, pairs: int,
                               window_s: float, max_model_len: int, seed: int = 4321) -> dict | None:
    """B requests decoding through `url` (the router of a 1P+1D on one host) while P idles and while it
    prefills `prompt_tokens`-token requests sent back to back through the same front, in alternating
    windows (idle, busy, idle, ..., idle): `interference_ratio`. Stop 49, 2-core box (P on one core, D on
    the other: they share caches and memory): 1.02-1.07 in five runs of this; ad-hoc probes that also
    counted the join steps gave 1.07-1.13 at B=2-5."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    started = [loop.create_future() for _ in range(batch)]
    times: list[list[float]] = [[] for _ in range(batch)]
    tasks = [asyncio.create_task(running_stream(session, url, {"prompt": prompt(context, rng),
                                                          "max_tokens": max_model_len - context - 1}, first, ts))
             for first, ts in zip(started, times)]
    windows, joins = [], []
    try:
        await asyncio.wait_for(asyncio.gather(*started), timeout=600)
        await asyncio.sleep(0.5)
        for k in range(2 * pairs + 1):
            t0 = time.perf_counter()
            while k % 2 and time.perf_counter() < t0 + window_s:
                out = await stream(session, url, {"prompt": prompt(prompt_tokens, rng), "max_tokens": 1})
                joins += [out["t0"] + t for t in out["times"][:1]]
            await asyncio.sleep(0 if k % 2 else window_s)
            windows.append(("busy" if k % 2 else "idle", t0, time.perf_counter()))
    finally:  # the running requests outlast the windows: end them (the router cancels them on D)
        for task in tasks:
            task.cancel()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
        for err in (e for e in ended if isinstance(e, Exception)):  # cancelled ones are not Exceptions
            log(f"decode beside prefill: a running request failed ({err!r})")
    out = interference_ratio(times, windows, joins)
    if out is None:
        log("decode beside prefill: no busy window between two idle ones had enough gaps; no profile section")
    return out

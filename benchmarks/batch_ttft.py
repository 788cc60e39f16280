"""Interactive TTFT while a batch runs, against a live stack (gateway + engine workers + batch worker).

    python benchmarks/batch_ttft.py --url http://127.0.0.1:8000 --api-key KEY \
        --output results/batch_interactive_ttft.json

Phases: (1) idle: ``--requests`` streaming chat requests one after another, each timed from sending to its
first token event; (2) a Batch API job of ``--batch-lines`` requests is created through /v1/files and
/v1/batches and, once its first lines are done, the same number of interactive requests is timed while it
runs; the batch must still be in progress when the last one is done (else the run is refused: it would not
have measured "under a batch"); (3) the batch is cancelled. The artifact (schema
``kernellab.bench.batch_ttft/v1``) records both phases' TTFT percentiles and their ratio; the acceptance
bound is busy p50 ≤ 2 × idle p50.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time

import httpx

SCHEMA = "kernellab.bench.batch_ttft/v1"
TOPICS = [
    "the ocean",
    "a library",
    "winter mornings",
    "a lighthouse",
    "old maps",
    "city trains",
    "a garden",
    "mountain roads",
    "a bakery",
    "thunderstorms",
    "a chess game",
    "desert nights",
]
BOUND = 2.0


def chat_body(model: str, i: int, max_tokens: int, phase: str) -> dict:
    # A different prompt each time (the shared chat template prefix is cached in both phases alike).
    topic = TOPICS[i % len(TOPICS)]
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Write one sentence about {topic} ({phase} {i})."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def ttft_once(client: httpx.Client, model: str, i: int, max_tokens: int, phase: str) -> float:
    started = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", json=chat_body(model, i, max_tokens, phase)) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"interactive request failed: {resp.status_code} {resp.read()[:300]!r}")
        # Read to the end (the request's slot is free before the next one); time the first token event.
        for line in resp.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0]["delta"].get("content") is not None:
                    first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def phase(client: httpx.Client, model: str, n: int, max_tokens: int, gap_s: float, name: str) -> list[float]:
    out = []
    for i in range(n):
        out.append(ttft_once(client, model, i, max_tokens, name))
        time.sleep(gap_s)
    return out


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "n": len(values),
        "p50_s": statistics.median(values),
        "p90_s": ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))],
        "mean_s": statistics.fmean(values),
        "min_s": ordered[0],
        "max_s": ordered[-1],
        "values_s": [round(v, 4) for v in values],
    }


def batch_input(model: str, lines: int, max_tokens: int) -> bytes:
    buf = io.StringIO()
    for i in range(lines):
        topic = TOPICS[i % len(TOPICS)]
        if i % 2:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Describe {topic} ({i})."}]}
        else:
            url, body = "/v1/completions", {"prompt": f"A short story about {topic} ({i}):"}
        body.update(model=model, max_tokens=max_tokens, temperature=0)
        buf.write(json.dumps({"custom_id": f"ttft-{i}", "method": "POST", "url": url, "body": body}) + "\n")
    return buf.getvalue().encode()


def wait_batch(client: httpx.Client, batch_id: str, until, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.get(f"/v1/batches/{batch_id}").raise_for_status().json()
        if until(batch):
            return batch
        if batch["status"] in ("failed", "expired", "cancelled", "completed") or time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id} is {batch['status']} ({batch['request_counts']}) while waiting")
        time.sleep(0.25)


def run(
    url: str,
    api_key: str,
    model: str,
    requests: int,
    max_tokens: int,
    batch_lines: int,
    batch_max_tokens: int,
    gap_s: float,
    timeout_s: float,
) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as client:
        for i in range(2):  # warm-up: first-request costs are not TTFT
            ttft_once(client, model, i, max_tokens, "warmup")
        idle = phase(client, model, requests, max_tokens, gap_s, "idle")

        upload = (
            client.post(
                "/v1/files",
                files={"file": ("ttft.jsonl", batch_input(model, batch_lines, batch_max_tokens))},
                data={"purpose": "batch"},
            )
            .raise_for_status()
            .json()
        )
        batch = (
            client.post(
                "/v1/batches",
                json={"input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            )
            .raise_for_status()
            .json()
        )
        batch = wait_batch(client, batch["id"], lambda b: b["request_counts"]["completed"] >= 1, timeout_s)
        before = batch["request_counts"]
        busy = phase(client, model, requests, max_tokens, gap_s, "busy")
        after = client.get(f"/v1/batches/{batch['id']}").raise_for_status().json()
        still_running = after["status"] == "in_progress"
        client.post(f"/v1/batches/{batch['id']}/cancel").raise_for_status()
        final = wait_batch(client, batch["id"], lambda b: b["status"] in ("cancelled", "completed"), timeout_s)
        client.delete(f"/v1/files/{upload['id']}")
    if not still_running:
        raise RuntimeError(
            f"the batch ended before the busy phase did ({after['request_counts']}): use more --batch-lines"
        )
    lines_during = after["request_counts"]["completed"] - before["completed"]
    idle_s, busy_s = summary(idle), summary(busy)
    return {
        "schema": SCHEMA,
        "model": model,
        "workload": {
            "interactive_requests": requests,
            "interactive_max_tokens": max_tokens,
            "gap_s": gap_s,
            "stream": True,
            "batch_lines": batch_lines,
            "batch_max_tokens": batch_max_tokens,
        },
        "idle": idle_s,
        "under_batch": busy_s,
        "ratio_p50": busy_s["p50_s"] / idle_s["p50_s"],
        "bound": BOUND,
        "within_bound": busy_s["p50_s"] <= BOUND * idle_s["p50_s"],
        "batch": {
            "id": final["id"],
            "lines_completed_during_busy_phase": lines_during,
            "final_status": final["status"],
            "final_counts": final["request_counts"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=15, help="interactive requests per phase")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens per interactive request")
    ap.add_argument("--batch-lines", type=int, default=400)
    ap.add_argument("--batch-max-tokens", type=int, default=8)
    ap.add_argument("--gap", type=float, default=0.2, help="seconds between interactive requests")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--output", default="results/batch_interactive_ttft.json")
    ap.add_argument("--notes", default="")
    args = ap.parse_args(argv)
    from kernellab.results import provenance, write

    load_before = os.getloadavg()[0]
    result = run(
        args.url,
        args.api_key,
        args.model,
        args.requests,
        args.max_tokens,
        args.batch_lines,
        args.batch_max_tokens,
        args.gap,
        args.timeout,
    )
    result["provenance"] = provenance("cpu")
    # The machine's 1-minute load around the run: other work on a shared host skews both phases' figures.
    result["stack"] = {
        "url": args.url,
        "notes": args.notes,
        "load_1m_before": load_before,
        "load_1m_after": os.getloadavg()[0],
    }
    write(args.output, result)
    idle, busy = result["idle"], result["under_batch"]
    print(f"{'phase':<12}{'n':>4}{'p50 ms':>10}{'p90 ms':>10}{'mean ms':>10}")
    for name, s in (("idle", idle), ("under batch", busy)):
        print(f"{name:<12}{s['n']:>4}{s['p50_s'] * 1e3:>10.1f}{s['p90_s'] * 1e3:>10.1f}{s['mean_s'] * 1e3:>10.1f}")
    print(
        f"p50 ratio {result['ratio_p50']:.2f} (bound {BOUND}); "
        f"{result['batch']['lines_completed_during_busy_phase']} batch lines finished during the busy phase"
    )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

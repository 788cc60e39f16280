"""The Batch API as real processes: the integration stack (gateway + one engine worker, from
``tests.support.stack``) on the private Redis, with a files directory shared with a Celery batch worker
(``kernellab batch-worker``).

One engine worker: batch and interactive requests then compete for the same engine, which is what the TTFT
test measures, and the 2 CPU cores are not split between two engines. Celery's timings are shortened so a
killed batch worker's job comes back within seconds: visibility timeout 5 s (with the lease, a message
redelivered while its batch still runs only waits), lease TTL 3 s, restore scan every second.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from tests.conftest import SMOL_PROMPTS as ALL_SMOL_PROMPTS
from tests.support.stack import MODEL, Stack, wait_for

BATCH_ENV = {
    "KERNELLAB_BATCH_VISIBILITY_TIMEOUT_S": "5",
    "KERNELLAB_BATCH_LEASE_TTL_S": "3",
    "KERNELLAB_BATCH_RESTORE_INTERVAL_S": "1",
}
TERMINAL = ("completed", "failed", "cancelled", "expired")
SMOL_PROMPTS = ALL_SMOL_PROMPTS[:10]


class BatchStack:
    def __init__(self, redis_url: str, workdir: Path):
        self.files_dir = workdir / "files"
        self.stack = Stack(redis_url, workdir, workers=1, KERNELLAB_FILES_DIR=str(self.files_dir), **BATCH_ENV)
        self.url, self.prefix = self.stack.url, self.stack.prefix
        self.batch_workers = 0
        self.batch_worker = None

    def start(self) -> BatchStack:
        self.stack.start()
        try:
            self.start_batch_worker()
        except Exception:
            self.stack.stop()
            raise
        return self

    def start_batch_worker(self) -> None:
        name = f"batch-worker-{self.batch_workers}"
        self.batch_workers += 1
        self.stack._spawn(name, ["batch-worker"], self.stack.env)
        self.batch_worker = self.stack.procs[name]
        log = self.stack.workdir / f"{name}.log"
        wait_for(
            lambda: self.batch_worker.poll() is None and "ready." in log.read_text(errors="replace"),
            120,
            f"{name} ready (log {log})",
            interval=0.2,
        )

    def kill_batch_worker(self) -> None:
        self.batch_worker.send_signal(signal.SIGKILL)
        self.batch_worker.wait(10)

    def openai(self):
        return self.stack.openai(timeout=60)

    def stop(self) -> None:
        self.stack.stop()


# ----------------------------------------------------------------- inputs and batches
def chat_line(custom_id: str, content: str, max_tokens: int = 8, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def completion_line(custom_id: str, prompt: str, max_tokens: int = 8, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body},
    }


def mixed_lines(n: int, max_tokens: int = 8, tag: str = "line") -> list[dict]:
    """``n`` requests, chat and completions alternating, every prompt different."""
    out = []
    for i in range(n):
        p = SMOL_PROMPTS[i % len(SMOL_PROMPTS)]
        if i % 2:
            out.append(chat_line(f"{tag}-{i}", f"{p} ({i})", max_tokens))
        else:
            out.append(completion_line(f"{tag}-{i}", f"Question {i}: {p}\nAnswer:", max_tokens))
    return out


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def start_batch(client, path: Path, endpoint: str = "/v1/chat/completions"):
    with path.open("rb") as f:
        file = client.files.create(file=f, purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")


def wait_batch(client, batch_id: str, until=lambda b: b.status in TERMINAL, timeout: float = 300.0):
    seen = {}

    def check():
        seen["b"] = client.batches.retrieve(batch_id)
        return until(seen["b"])

    try:
        wait_for(check, timeout, f"batch {batch_id}", interval=0.25)
    except TimeoutError:
        raise AssertionError(f"batch {batch_id} stuck: {seen.get('b')}") from None
    return seen["b"]


def file_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def comparable(line: dict) -> dict:
    """A line without what differs from run to run: ids, timestamps, prefix-cache hits, and logprob values
    (the chosen tokens and their top alternatives are kept; the values differ in the last float32 digits
    when requests share an engine step with different neighbours: see ``logprob_values``)."""
    line = json.loads(json.dumps(line))
    line.pop("id")
    response = line.get("response")
    if response:
        response.pop("request_id")
        body = response["body"]
        for key in ("id", "created"):
            body.pop(key, None)
        if "usage" in body:
            body["usage"].pop("prompt_tokens_details", None)
        for choice in body.get("choices", []):
            lp = choice.get("logprobs")
            if lp is not None and "tokens" in lp:
                choice["logprobs"] = {
                    "tokens": lp["tokens"],
                    "text_offset": lp["text_offset"],
                    "top": [sorted(t) for t in lp["top_logprobs"]],
                }
            elif lp is not None:
                choice["logprobs"] = [(c["token"], [t["token"] for t in c["top_logprobs"]]) for c in lp["content"]]
    return line


def logprob_values(line: dict) -> list[float]:
    lp = line["response"]["body"]["choices"][0]["logprobs"]
    if "token_logprobs" in lp:
        return lp["token_logprobs"] + [v for top in lp["top_logprobs"] for v in sorted(top.values())]
    return [c["logprob"] for c in lp["content"]]


def reference_texts(llm, lines: list[dict]) -> list:
    """Greedy outputs of the engine driven directly (tests/integration/conftest.py's offline_llm)."""
    from kernellab.runtime.request.sampling import SamplingParams

    prompts = [x["body"]["messages"] if "messages" in x["body"] else x["body"]["prompt"] for x in lines]
    params = [SamplingParams(max_tokens=x["body"]["max_tokens"], temperature=0) for x in lines]
    out = []
    for start in range(0, len(prompts), 48):  # the reference engine's 256 KV blocks hold 48 of these at once
        out += llm.generate(prompts[start : start + 48], params[start : start + 48])
    return out


def body_text(line: dict) -> str:
    choice = line["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))

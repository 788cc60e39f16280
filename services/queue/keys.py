"""Redis key names, all under one prefix (``kl:`` by default) so that deployments and tests can share a Redis.

Request streams are per model, so workers of one model never pick up another model's requests.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "workers"  # the consumer group on every request stream
PRIORITIES = ("interactive", "batch")  # read in this order: batch work never starves chat


@dataclass(frozen=True)
class Keys:
    prefix: str
    model: str

    def requests(self, priority: str) -> str:
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}")
        return f"{self.prefix}req:{self.model}:{priority}"

    @property
    def request_streams(self) -> tuple[str, ...]:
        return tuple(self.requests(p) for p in PRIORITIES)

    def output(self, engine_id: str) -> str:
        """Everything the workers emitted for one choice (``{request_id}-{index}``); expires after the TTL."""
        return f"{self.prefix}out:{engine_id}"

    def meta(self, request_id: str) -> str:
        """``{choices}:{owner}`` of a request (owner: its tenant's API-key digest, "" without keys), so any
        gateway can cancel it for its owner."""
        return f"{self.prefix}meta:{request_id}"

    @property
    def cancel(self) -> str:
        """Broadcast stream of cancel messages; every worker reads all of it."""
        return f"{self.prefix}cancel"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}dlq:{self.model}"

    @property
    def workers(self) -> str:
        """Sorted set: worker id → time of its last heartbeat."""
        return f"{self.prefix}workers:{self.model}"

    def heartbeat(self, worker_id: str) -> str:
        return f"{self.prefix}hb:{self.model}:{worker_id}"

    def wake(self, gateway_id: str) -> str:
        """A gateway's own stream: writing to it wakes its output reader so it starts reading a new request."""
        return f"{self.prefix}wake:{gateway_id}"

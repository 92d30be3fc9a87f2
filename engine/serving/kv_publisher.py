"""KV events on the wire, as vLLM publishes them (vllm/distributed/kv_events.py, ZmqEventPublisher): a ZMQ PUB
socket sending [topic, sequence number (8 bytes, big-endian), msgpack batch] per engine step. The batch is an
array [timestamp, events, data-parallel rank]; each event a map tagged by its class name under "type", with
vLLM's field names:
  {"type": "BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name}
  {"type": "BlockRemoved", block_hashes, medium}
  {"type": "AllBlocksCleared"}
That is what vllm-router 0.1.17 decodes: it refuses events that are arrays ("KV event must be a tagged map") and
batches that are maps ("KV event batch must be an array").

The engine's step loop only queues a step's events: a thread encodes and sends them. The queue is bounded and a
full one drops the batch (counted), and a PUB socket drops messages to a subscriber past its high-water mark, so
a slow or absent subscriber never blocks a step or grows memory.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import msgpack
import zmq

from engine.kv.events import Cleared, Event, Removed, Stored

log = logging.getLogger("pagoda")
MEDIUM = "GPU"              # vLLM's name for the engine's own KV memory, whatever the device: the router's first tier


def encode(events: list[Event], block_size: int, ts: float) -> bytes:
    out = []
    for e in events:
        if isinstance(e, Stored):
            out.append({"type": "BlockStored", "block_hashes": e.hashes, "parent_block_hash": e.parent,
                        "token_ids": e.tokens, "block_size": block_size, "lora_id": None, "medium": MEDIUM,
                        "lora_name": None})
        elif isinstance(e, Removed):
            out.append({"type": "BlockRemoved", "block_hashes": e.hashes, "medium": MEDIUM})
        elif isinstance(e, Cleared):
            out.append({"type": "AllBlocksCleared"})
    return msgpack.packb([ts, out, 0])


class Publisher:
    def __init__(self, endpoint: str, topic: str, block_size: int, max_batches: int = 1024,
                 hwm: int = 100_000) -> None:
        self.block_size, self.topic = block_size, topic.encode()
        self.queue: queue.Queue[list[Event] | None] = queue.Queue(maxsize=max_batches)
        self.dropped = 0                  # batches dropped on a full queue
        self.sent = 0
        self.socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.set_hwm(hwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        # as vLLM decides: a wildcard address is bound, anything else connected to
        try:
            if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self.socket.bind(endpoint)
            else:
                self.socket.connect(endpoint)
        except zmq.ZMQError as e:
            self.socket.close(linger=0)
            raise ValueError(f"kv_events_endpoint: cannot use {endpoint!r} ({e})") from None
        self.endpoint = endpoint
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()

    def publish(self, events: list[Event]) -> None:
        """Queue one step's events; never waits."""
        try:
            self.queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        seq = 0
        while (events := self.queue.get()) is not None:
            try:
                payload = encode(events, self.block_size, time.time())
                self.socket.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
                seq += 1
                self.sent += 1
            except zmq.Again:
                self.dropped += 1
            except Exception:                      # a bad batch must not end the publisher
                log.exception("kv events: publishing a batch failed")

    def close(self) -> None:
        try:
            self.queue.put(None, timeout=1)
        except queue.Full:
            pass
        self.thread.join(timeout=2)
        self.socket.close(linger=0)

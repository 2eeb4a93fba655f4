"""``Subscriber``: collects every KV event batch a vLLM engine publishes (its ZMQ
publisher connects to a concrete tcp address, so the subscriber binds a random loopback
port); ``drain`` waits until no more arrive."""

from __future__ import annotations

import threading
import time

import zmq

from kvoffload.events.codec import decode


class Subscriber:
    """Collects every batch a vLLM engine publishes. vLLM's publisher connects to a
    concrete tcp address (it binds only wildcard ones), so the subscriber binds."""

    def __init__(self):
        self.events = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self._sock.poll(50):
                _topic, _seq, payload = self._sock.recv_multipart()
                self.events.extend(decode(payload).events)

    def close(self):
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


def drain(llm, sub):
    deadline = time.time() + 5
    n = -1
    while time.time() < deadline and n != len(sub.events):
        n = len(sub.events)
        time.sleep(0.3)

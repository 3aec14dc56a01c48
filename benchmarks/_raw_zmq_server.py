"""Baseline for the fetch benchmark: a bare ROUTER that answers every request with one payload frame.

``python -m mmcache.benchmarks._raw_zmq_server ADDRESS NBYTES`` binds ADDRESS (tcp) and replies to each
request ``[identity, b"<n>"]`` with ``[identity, payload[:n]]`` (at most NBYTES, sent without a
copy), until SIGTERM. It prints ``ready <endpoint>`` once bound.
"""

from __future__ import annotations

import signal
import sys

import numpy as np
import zmq


def main() -> None:
    address, nbytes = sys.argv[1], int(sys.argv[2])
    payload = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    try:
        while True:
            frames = sock.recv_multipart(copy=False)
            n = int(frames[-1].bytes or nbytes)
            sock.send_multipart([frames[0], payload[:n]], copy=False)
    finally:
        sock.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    main()

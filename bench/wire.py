"""`python -m bench.wire`: the frontend <-> vrnicd frame codec, version 1 (JSON) against version 2 (binary).

Host only, no sockets: encode() and FrameDecoder.feed_frames() of the requests and replies the guest library
exchanges most (vrnic/frontend/guest_library.py), best of several timeit repeats, in µs per frame.
"""

from __future__ import annotations

import timeit
from typing import Any

from vrnic.core.framing import BINARY_VERSION, JSON_VERSION, FrameDecoder, encode

ID = 0x3A_5F12_9C44  # request ids start at a random point below 2**40 (frontend.channel)
HANDLE = 0x51D3_77AB_0C2E_9F01  # handles are random 63-bit numbers (core.handles)
ADDR = 0x7F3A_1C20_0000
GID = "fe80:0000:0000:0000:0200:5eff:fe12:0001"

MESSAGES: dict[str, dict[str, Any]] = {
    "null_rpc request": {"id": ID, "op": "null_rpc", "args": {}},
    "null_rpc reply": {"id": ID, "ok": True, "result": {}},
    "create_cq request": {"id": ID, "op": "create_cq", "args": {"cqe": 256, "ring": ADDR}},
    "create_cq reply": {"id": ID, "ok": True, "result": {"cq": HANDLE, "cqe": 256}},
    "reg_mr request": {"id": ID, "op": "reg_mr", "args": {"pd": HANDLE, "addr": ADDR, "length": 65536, "access": 1}},
    "reg_mr reply": {"id": ID, "ok": True, "result": {"mr": HANDLE, "lkey": 0x1F2E3D, "rkey": 0x1F2E3D,
                                                      "addr": ADDR, "length": 65536}},
    "modify_qp request": {"id": ID, "op": "modify_qp", "args": {"qp": HANDLE, "state": "rtr", "remote_gid": GID,
                                                                "remote_qpn": 0x12345, "access": 15}},
    "modify_qp reply": {"id": ID, "ok": True, "result": {"state": "rtr"}},
    "error reply": {"id": ID, "ok": False, "error": {"code": "not_found", "message": f"no qp {HANDLE}"}},
}


def best_us(statement: Any, number: int) -> float:
    return min(timeit.repeat(statement, number=number, repeat=7)) / number * 1e6


def measure(number: int = 20000) -> list[tuple[str, int, float, float, int, float, float]]:
    """Per message: v1 bytes, encode µs, decode µs; v2 bytes, encode µs, decode µs."""
    rows = []
    for name, message in MESSAGES.items():
        row: list[Any] = [name]
        for version in (JSON_VERSION, BINARY_VERSION):
            frame = encode(message, version)
            decoder = FrameDecoder()
            assert decoder.feed_frames(frame) == [(version, message)]
            row += [len(frame), best_us(lambda m=message, v=version: encode(m, v), number),
                    best_us(lambda f=frame, d=decoder: d.feed_frames(f), number)]
        rows.append(tuple(row))
    return rows  # type: ignore[return-value]


def main() -> None:
    print(f"{'message':20} {'v1 B':>5} {'v1 enc':>7} {'v1 dec':>7} {'v2 B':>5} {'v2 enc':>7} {'v2 dec':>7}"
          f" {'v2/v1 enc+dec':>14}")
    for name, b1, e1, d1, b2, e2, d2 in measure():
        print(f"{name:20} {b1:5d} {e1:7.2f} {d1:7.2f} {b2:5d} {e2:7.2f} {d2:7.2f} {(e2 + d2) / (e1 + d1):14.2f}")
    print("(bytes per frame with its 8-byte header; µs per frame, best of 7)")


if __name__ == "__main__":
    main()

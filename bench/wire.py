"""`python -m bench.wire`: the frontend <-> vrnicd frame codec, version 1 (JSON), 2 (binary) and 3 (MessagePack).

Host only, no sockets: encode() and FrameDecoder.feed_frames() of the requests and replies the guest library
exchanges most (vrnic/frontend/guest_library.py), best of several timeit repeats, in µs per frame.
"""

from __future__ import annotations

import timeit
from typing import Any

from vrnic.core.framing import VERSIONS, FrameDecoder, encode

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


def measure(number: int = 20000) -> list[tuple[Any, ...]]:
    """Per message: its name, then for each version spoken here (VERSIONS): bytes, encode µs, decode µs."""
    rows = []
    for name, message in MESSAGES.items():
        row: list[Any] = [name]
        for version in VERSIONS:
            frame = encode(message, version)
            decoder = FrameDecoder()
            assert decoder.feed_frames(frame) == [(version, message)]
            row += [len(frame), best_us(lambda m=message, v=version: encode(m, v), number),
                    best_us(lambda f=frame, d=decoder: d.feed_frames(f), number)]
        rows.append(tuple(row))
    return rows


def main() -> None:
    head = "".join(f" {f'v{v} B':>5} {f'v{v} enc':>7} {f'v{v} dec':>7}" for v in VERSIONS)
    ratios = "".join(f" {f'v{v}/v1':>6}" for v in VERSIONS[1:])
    print(f"{'message':20}{head}{ratios}")
    for name, *cells in measure():
        sizes = cells[0::3]
        costs = [e + d for e, d in zip(cells[1::3], cells[2::3], strict=True)]
        line = "".join(f" {b:5d} {e:7.2f} {d:7.2f}" for b, e, d in zip(sizes, cells[1::3], cells[2::3], strict=True))
        print(f"{name:20}{line}" + "".join(f" {c / costs[0]:6.2f}" for c in costs[1:]))
    print("(bytes per frame with its 8-byte header; µs per frame, best of 7; the ratios are encode + decode)")


if __name__ == "__main__":
    main()

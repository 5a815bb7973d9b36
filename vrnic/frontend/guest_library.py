"""Context, PD, MR, CQ and QP for guest programs, as context managers like pyverbs."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, cast

from vrnic.core.framing import MAX_BATCH
from vrnic.core.rings import (
    CQ_SLOT,
    RQ_SLOT,
    SQ_SLOT,
    Access,
    Completion,
    RecvRequest,
    Ring,
    RingCorrupt,
    RingFlags,
    SendRequest,
    Sge,
    pack_recv,
    pack_send,
    unpack_completion,
)
from vrnic.errors import Conflict, DeviceError, InvalidArgument, QuotaExceeded, VrnicError
from vrnic.frontend.channel import DEFAULT_PORT, Channel, PortChannel, UnixChannel
from vrnic.frontend.direct import DirectCq, DirectDevice, DirectQp
from vrnic.frontend.memory import PAGE, Arena, MemfdArena, VmArena

if TYPE_CHECKING:  # pydantic: not imported in a VM guest
    from vrnic.core.specs import AttachInfo

DEFAULT_ARENA = 16 << 20
_T = TypeVar("_T")

PD_POOL = 8  # PDs a context asks vrnicd for at once (fewer when the quota leaves less room)
CQ_POOL = 4  # CQs of one size a context asks vrnicd for at once on the shared-ring engine (fewer likewise)
CQ_POOL_RING_BYTES = 64 << 10  # larger rings are not pooled: spare ones would take too much of the arena
QP_POOL = 4  # QPs of one shape a context first asks vrnicd for at once on the shared-ring engine (1 if the quota
# is short); each later refill of that shape asks for twice as many, up to QP_POOL_MAX: a guest that makes many QPs
# one by one pays a round trip per few dozen of them, and never holds more spares than it has used
QP_POOL_MAX = 32
QP_POOL_GROWTH = 2
QP_POOL_RING_BYTES = 64 << 10  # a QP whose two rings take more is not pooled, for the same reason
MR_POOL = 4  # MRs of one shape (PD, length, access) a context first asks vrnicd for at once on the shared-ring
# engine; each later refill of that shape asks for MR_POOL_GROWTH times as many, up to MR_POOL_MAX and to MR_POOL of
# the largest pooled MRs' bytes (spares pin memory): a guest that makes many small MRs one by one pays a round trip
# per few dozen of them
MR_POOL_MAX = 32
MR_POOL_GROWTH = 4  # not 2 as QPs: a refill costs vrnicd about as much as 20 more registrations (issue 14, session
# 45: 4.2 ms for 4 MRs, 11.1 for 32), so a loop of 50 is cheaper as 4 + 16 + 32 (3 refills, 52 MRs) than as
# 4 + 8 + 16 + 32 (4 refills, 60 MRs); a spare MR is a page, a spare QP two rings and a NIC QP
MR_POOL_BYTES = 64 << 10  # larger MRs are not pooled: spare ones would pin, and take, too much of the arena
DEFAULT_VM_ARENA = 8 << 20  # four 2 MiB hugepages
VM_POLL_SLEEP_S = 0.0002  # a VM guest has no completion eventfd: it polls, sleeping this long between polls
DIRECT_SPIN_S = 0.02  # a direct guest polls the NIC's CQ as native verbs programs do: it spins this long, then naps
DIRECT_POLL_SLEEP_S = 0.00005


def _readable(fd: int, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


class _Resource:
    closed = False

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Buffer:
    """A piece of the shared arena: offset is where it lies here, addr what SGEs and remote peers use
    (the same number for a container guest; a guest-physical address in a VM)."""

    ctx: Context
    offset: int
    addr: int
    length: int

    def write(self, data: bytes, offset: int = 0) -> None:
        if offset < 0 or offset + len(data) > self.length:
            raise InvalidArgument(f"{len(data)} bytes at {offset} do not fit a {self.length}-byte buffer")
        start = self.offset + offset
        self.ctx.view[start:start + len(data)] = data

    def read(self, length: int | None = None, offset: int = 0) -> bytes:
        length = self.length - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.length:
            raise InvalidArgument(f"{length} bytes at {offset} are outside a {self.length}-byte buffer")
        start = self.offset + offset
        return bytes(self.ctx.view[start:start + length])


class Context(_Resource):
    """An attached vRNIC: the channel to vrnicd, the shared arena and the doorbell.

    Context(socket, token) / Context.attach(info): a container guest (memfd arena, eventfd doorbell).
    Context.attach_vm(): a guest program inside a VM with a vRNIC attached (its virtio-serial port).
    """

    def __init__(self, socket_path: str, token: str, arena_bytes: int = DEFAULT_ARENA,
                 busy_poll: bool = False) -> None:
        self.doorbell_fd: int | None = None
        self.notify_fd: int | None = None
        # Connected first: vrnicd wakes and accepts while this guest builds its arena (issue 14)
        channel = UnixChannel(socket_path)
        arena: MemfdArena | None = None
        try:
            arena = MemfdArena.new(arena_bytes)
            doorbell = self.doorbell_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            notify = self.notify_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except BaseException:
            channel.close()
            if arena is not None:
                arena.close()
            self._close_fds()
            raise
        try:
            self._open(arena, lambda: channel,
                       lambda ch: ch.call("attach", fds=[arena.fd, doorbell, notify], token=token,
                                          busy_poll=busy_poll))
        except BaseException:
            self._close_fds()
            raise

    def _open(self, arena: Arena, connect: Callable[[], Channel],
              attach: Callable[[Channel], dict[str, Any]]) -> None:
        self.arena = arena
        self.view = arena.view
        self.words = arena.words
        self.allocator = arena.allocator
        self.channel: Channel | None = None
        self.direct: DirectDevice | None = None
        try:
            self.channel = connect()
            info = attach(self.channel)
            fds = self.channel.take_fds()
            self.engine: str = info.get("engine", "ring")
            if self.engine == "direct":
                if len(fds) != 2:
                    for fd in fds:
                        os.close(fd)
                    raise DeviceError(f"vrnicd chose the direct engine but sent {len(fds)} descriptors, not the "
                                      f"uverbs fd and the translation generation")
                self.direct = DirectDevice(fds[0], fds[1], str(info.get("queue_format")), self.call)
            else:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            self._release_local()
            raise
        self.spare_pds: list[int] = []  # PDs vrnicd allocated for this context and no PD object holds
        self.spare_cqs: dict[int, list[tuple[int, Buffer]]] = {}  # by size: CQs (and rings) no CQ object holds
        self.spare_qps: dict[QpShape, list[SpareQp]] = {}  # by shape: new QPs no QP object holds yet
        self.qp_refill: dict[QpShape, int] = {}  # by shape: how many QPs its pool's next refill asks for
        self.spare_mrs: dict[MrShape, list[SpareMr]] = {}  # by shape: new MRs (on their buffers) no MR object holds
        self.mr_refill: dict[MrShape, int] = {}  # by shape: how many MRs its pool's next refill asks for
        # by shape: the buffers of its pool's next refill, allocated and provisioned while the last one was in flight
        self.next_mr_buffers: dict[MrShape, list[Buffer]] = {}
        self.vrnic_id: str = info["vrnic_id"]
        self.gid: str = info["virtual_gid"]
        self.ip: str | None = info.get("virtual_ip")  # its address in the VPC, if it has one (frontend.cm)
        # Batches as one shape (create_qps) and towards one peer (connect_qps); a vrnicd from before takes items
        self.shape_batches: bool = info.get("shape_batches") is True
        # dereg_mrs and destroy_qps; with a vrnicd from before, one request per object
        self.teardown_batches: bool = info.get("teardown_batches") is True

    @classmethod
    def attach(cls, info: AttachInfo, arena_bytes: int = DEFAULT_ARENA, busy_poll: bool = False) -> Context:
        if info.socket_path is None or info.token is None:
            raise InvalidArgument(f"vRNIC {info.vrnic_id} ({info.mode}) has no paravirtual channel")
        return cls(info.socket_path, info.token, arena_bytes, busy_poll)

    @classmethod
    def attach_vm(cls, port: str = DEFAULT_PORT, arena_bytes: int = DEFAULT_VM_ARENA, busy_poll: bool = False,
                  hugepages: bool | None = None) -> Context:
        """Inside a VM: the vRNIC vrnicd serves on virtio-serial port `port`. Needs root (pagemap)."""
        return cls.over_channel(VmArena(arena_bytes, hugepages), lambda: PortChannel(port), busy_poll)

    @classmethod
    def over_channel(cls, arena: Arena, connect: Callable[[], Channel], busy_poll: bool = False) -> Context:
        """A guest whose memory vrnicd already maps (a VM's RAM): no descriptors, the doorbell is a message
        and completions are polled. The arena is closed with the context (also when attaching fails)."""
        ctx = cls.__new__(cls)
        ctx.doorbell_fd = ctx.notify_fd = None
        ctx._open(arena, connect, lambda ch: ch.call("attach", busy_poll=busy_poll))
        return ctx

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        return self.open_channel().call(op, **args)

    def call_meanwhile(self, op: str, meanwhile: Callable[[], None], args: dict[str, Any]) -> dict[str, Any]:
        """call(op, **args), with meanwhile run while vrnicd works on it (Channel.call_meanwhile)."""
        return self.open_channel().call_meanwhile(op, meanwhile, args)

    def open_channel(self) -> Channel:
        """The channel to vrnicd; VrnicError once the context is closed (also for handouts, which send nothing)."""
        if self.closed or self.channel is None:
            raise VrnicError("the context is closed")
        return self.channel

    @property
    def spare_mr_count(self) -> int:
        """MRs in this context's pools: registered on the NIC, counted by the quota, that no MR object holds yet."""
        return sum(len(pool) for pool in self.spare_mrs.values())

    @property
    def spare_qp_count(self) -> int:
        """QPs in this context's pools: real QPs on the NIC, counted by the quota, that no QP object holds yet."""
        return sum(len(pool) for pool in self.spare_qps.values())

    def null_rpc(self) -> None:
        """An empty round trip to vrnicd: the floor under every control verb (benchmarks)."""
        self.call("null_rpc")

    def query_device(self) -> dict[str, Any]:
        return self.call("query_device")

    def query_port(self, port: int = 1) -> dict[str, Any]:
        return self.call("query_port", port=port)

    def query_gid(self, port: int = 1, index: int = 0) -> str:
        return str(self.call("query_gid", port=port, index=index)["gid"])

    def set_busy_poll(self, enabled: bool) -> None:
        self.call("busy_poll", enabled=enabled)

    def alloc(self, length: int, align: int = 64, spare: bool = False) -> Buffer:
        """length bytes of the arena. The buffers of spare MRs are the pool's, not the caller's: when the arena
        is short they are given back first (not for a buffer that is itself a spare's, which is simply not made)."""
        offset = self._with_room(lambda: self.allocator.alloc(length, align), spare)
        return Buffer(self, offset, self.arena.wire(offset), length)

    def alloc_many(self, lengths: list[int], align: int = 64, spare: bool = False) -> list[Buffer]:
        """Buffers side by side, in one search of the arena (spare MRs given back first if it is short, unless the
        buffers are themselves a pool's spares)."""
        offsets = self._with_room(lambda: self.allocator.alloc_many(lengths, align), spare)
        wire = self.arena.wire
        return [Buffer(self, offset, wire(offset), length) for offset, length in zip(offsets, lengths, strict=True)]

    def _with_room(self, take: Callable[[], _T], spare: bool = False) -> _T:
        """take() from the arena, once more after giving back the spare MRs and the buffers prepared for their
        pools' next refills if it was short."""
        try:
            return take()
        except QuotaExceeded as exc:
            if spare or exc.limit != "arena_bytes":
                raise
            freed = _free_prepared_buffers(self)
            if not _give_back_spare_mrs(self) and not freed:
                raise
            return take()

    def provision(self, buffers: list[Buffer]) -> None:
        """The arena's pages under buffers about to be registered, allocated by this process (MemfdArena.provision:
        vrnicd registers no page of a container's arena the guest did not allocate): one call per run of buffers
        side by side, as a pool's are."""
        runs: list[list[int]] = []
        for b in sorted(buffers, key=lambda b: b.offset):
            if runs and b.offset <= runs[-1][1] + PAGE:
                runs[-1][1] = max(runs[-1][1], b.offset + b.length)
            else:
                runs.append([b.offset, b.offset + b.length])
        for start, end in runs:
            self.arena.provision(start, end - start)

    def free(self, buffer: Buffer) -> None:
        self.allocator.free(buffer.offset)

    def ring_doorbell(self) -> None:
        if self.doorbell_fd is not None:
            os.eventfd_write(self.doorbell_fd, 1)
        elif self.channel is not None:
            self.channel.notify("doorbell")

    def close(self) -> None:
        if self.closed:
            return
        # vrnicd may be gone or have dropped us already; it cleans up on disconnect either way.
        detached = False
        with contextlib.suppress(VrnicError):
            self.call("detach")
            detached = True  # vrnicd tore the session down, its mapping of the arena too, before it answered
        self.closed = True
        self._release_local(detached)

    def _release_local(self, detached: bool = False) -> None:
        if self.direct is not None:
            self.direct.close()
        if self.channel is not None:
            self.channel.close()
        if detached:
            self.arena.retire()
        else:
            self.arena.close()
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self.doorbell_fd, self.notify_fd):
            if fd is not None:
                os.close(fd)
        self.doorbell_fd = self.notify_fd = None


class PD(_Resource):
    """A protection domain, handed out from the context's pool of PDs (pre-setup): vrnicd allocates up to
    PD_POOL of them in one request (within the quota, which they count against), and a PD closed here goes back
    to the pool, so creating one is no round trip. The pool goes with the context."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.users = 0  # MRs and QPs on it: as vrnicd does, a PD in use is not given up
        ctx.open_channel()
        if not ctx.spare_pds:
            ctx.spare_pds = [int(h) for h in ctx.call("alloc_pds", count=PD_POOL)["pds"]][::-1]
        self.handle = ctx.spare_pds.pop()

    def close(self) -> None:
        if self.closed:
            return
        if self.users:
            raise Conflict(f"PD {self.handle} still has {self.users} MR(s)/QP(s)", current_state="in_use")
        if not self.ctx.closed:
            _give_back_spare_mrs(self.ctx, on_pd=self.handle)  # a PD handed out again starts with no MR on it
            self.ctx.spare_pds.append(self.handle)
        self.closed = True


class MR(_Resource):
    """A registered range of the arena: give a Buffer, or a length to allocate one.

    Given a length of at most MR_POOL_BYTES, on the shared-ring engine, the MR is handed out from the context's
    pool of MRs of its shape (PD, length, access; pre-setup, as CQs and QPs are): vrnicd registers MR_POOL of them,
    each on a buffer of its own, in one request, and MR_POOL_GROWTH times as many at each later refill of that shape
    (up to MR_POOL_MAX, and no more bytes than MR_POOL of the largest pooled MRs). The spare MRs are registered on the
    NIC and count against the quota (MRs and pinned bytes). A closed MR is deregistered, never handed out again:
    its key may have reached a peer. When the quota refuses a pool, the spare MRs of every shape are given back
    and the pool is asked for again (vrnicd makes as many as the quota allows, at least one), so a tenant still
    gets exactly its quota."""

    def __init__(self, pd: PD, buffer: Buffer | int, access: int = Access.LOCAL_WRITE) -> None:
        self.pd = pd
        ctx = pd.ctx
        self.owned = not isinstance(buffer, Buffer)
        if isinstance(buffer, int) and ctx.direct is None and 0 < buffer <= MR_POOL_BYTES:
            ctx.open_channel()
            shape = (pd.handle, buffer, int(access))
            # The plain tuple finds the pool's MrShape key, which hashes and compares as its fields do, without a
            # NamedTuple built per handout (0.13 of 0.75 us on the host; issue 14)
            spares = ctx.spare_mrs.get(cast(MrShape, shape))
            self.handle, self.lkey, self.buffer = spares.pop() if spares else _spare_mr(ctx, MrShape(*shape))
            self.rkey = self.lkey
            pd.users += 1
            return
        self.buffer = ctx.alloc(buffer, _mr_align(buffer)) if isinstance(buffer, int) else buffer
        try:
            ctx.provision([self.buffer])
            reply = ctx.call("reg_mr", pd=pd.handle, addr=self.buffer.addr, length=self.buffer.length,
                             access=int(access))
        except BaseException:
            if self.owned:
                ctx.free(self.buffer)
            raise
        pd.users += 1
        self.handle = int(reply["mr"])
        self.lkey = int(reply["lkey"])
        self.rkey = int(reply["rkey"])
        if ctx.direct is not None:
            ctx.direct.learn_mr(reply)

    @property
    def addr(self) -> int:
        return self.buffer.addr

    @property
    def length(self) -> int:
        return self.buffer.length

    def sge(self, offset: int = 0, length: int | None = None) -> Sge:
        length = self.length - offset if length is None else length
        return Sge(self.addr + offset, length, self.lkey)

    def write(self, data: bytes, offset: int = 0) -> None:
        self.buffer.write(data, offset)

    def read(self, length: int | None = None, offset: int = 0) -> bytes:
        return self.buffer.read(length, offset)

    def close(self) -> None:
        MR.close_many((self,))

    @staticmethod
    def close_many(mrs: Iterable[MR]) -> None:
        """close() of each MR, in one dereg_mrs per context (up to MAX_BATCH MRs a request)."""
        for ctx, group in _open_by_context(mrs):
            for mr in group:
                mr._forget_key()
            _teardown(ctx, group, "dereg_mrs", "dereg_mr", "mr", MR._forget)

    def _forget_key(self) -> None:
        """Before the MR goes: a direct guest stops posting with its key."""
        if self.pd.ctx.direct is not None:
            self.pd.ctx.direct.forget_mr(self.lkey)

    def _forget(self) -> None:
        """What this process holds for the MR, once vrnicd deregistered it (or the context closed)."""
        if not self.closed:
            if self.owned and not self.pd.ctx.closed:
                self.pd.ctx.free(self.buffer)
            self.pd.users -= 1
        self.closed = True


class MrShape(NamedTuple):
    """What an MR of a length asks for; new MRs of one shape are interchangeable before they are handed out.
    A tuple, not a frozen dataclass: every pooled MR() builds one and looks it up, and a tuple's hash and
    equality are the interpreter's own (1.5 -> 0.3 us on the host; more under TCG, issue 14)."""
    pd: int
    length: int
    access: int


class SpareMr(NamedTuple):
    handle: int
    key: int  # lkey and rkey: vrnicd gives an MR one virtual key for both
    buffer: Buffer


def _spare_mr(ctx: Context, shape: MrShape) -> SpareMr:
    spares = ctx.spare_mrs.setdefault(shape, [])
    if not spares:
        spares += _reg_mrs(ctx, shape)[::-1]
    return spares.pop()


def _reg_mrs(ctx: Context, shape: MrShape) -> list[SpareMr]:
    """New MRs of this shape on buffers of their own, in one reg_mrs: MR_POOL at the shape's first refill,
    MR_POOL_GROWTH times as many at each later one (up to MR_POOL_MAX, and MR_POOL * MR_POOL_BYTES bytes), as many
    as the arena and the quota allow (at least one). When the quota refuses, the spare MRs of every shape are given
    back and the request is made once more. A refill that got fewer than it asked for makes the next one MR_POOL
    again."""
    want = _mr_pool_want(ctx.mr_refill.get(shape, MR_POOL), shape.length)
    buffers = _prepared_buffers(ctx, shape, want)
    refused = False
    try:
        if buffers is None:
            buffers = _pool_buffers(ctx, shape.length, want)
            ctx.provision(buffers)
        request = {"pd": shape.pd, "addrs": [b.addr for b in buffers], "length": shape.length,
                   "access": shape.access}
        after = _next_mr_refill(want, shape.length)
        try:
            reply = ctx.call_meanwhile("reg_mrs", lambda: _prepare_buffers(ctx, shape, after), request)
        except QuotaExceeded:
            refused = True
            if not _give_back_spare_mrs(ctx):
                raise
            reply = ctx.call("reg_mrs", **request)
    except BaseException:
        _free_all(ctx, buffers or [])
        _free_all(ctx, ctx.next_mr_buffers.pop(shape, []))  # a refused refill has no next one to prepare for
        raise
    handles = reply["mrs"]
    # tuple.__new__ as SpareMr's own __new__ does, less its Python frame per MR
    made = [tuple.__new__(SpareMr, mr) for mr in zip(handles, reply["keys"], buffers[:len(handles)], strict=True)]
    _free_all(ctx, buffers[len(made):])
    ctx.mr_refill[shape] = MR_POOL if refused or len(made) < want else after
    return made


def _prepared_buffers(ctx: Context, shape: MrShape, want: int) -> list[Buffer] | None:
    """The buffers prepared for this refill of shape (_prepare_buffers), want of them (the rest freed), or None if
    fewer were prepared than it wants."""
    prepared = ctx.next_mr_buffers.pop(shape, None)
    if prepared is None:
        return None
    if len(prepared) < want:
        _free_all(ctx, prepared)
        return None
    _free_all(ctx, prepared[want:])
    return prepared[:want]


def _prepare_buffers(ctx: Context, shape: MrShape, count: int) -> None:
    """While a refill of shape is in flight, the buffers of its next one, count side by side, allocated and their
    pages provisioned: the guest would otherwise wait for vrnicd with nothing to do, then do this work before the
    next request (lab, 0.2-0.5 ms a refill; issue 14). Nothing when the arena has no room for them in one piece:
    they are never made by taking room from anything else. They are freed if the pool is given back."""
    if shape in ctx.next_mr_buffers:
        return
    try:
        buffers = ctx.alloc_many([shape.length] * count, _mr_align(shape.length), spare=True)
    except VrnicError:
        return
    try:
        ctx.provision(buffers)
    except VrnicError:
        _free_all(ctx, buffers)
        return
    ctx.next_mr_buffers[shape] = buffers


def _free_all(ctx: Context, buffers: list[Buffer]) -> None:
    for buffer in buffers:
        ctx.free(buffer)


def _mr_pool_want(refill: int, length: int) -> int:
    """How many MRs of length a refill asks for: refill, and no more than MR_POOL of the largest pooled MRs' bytes."""
    return min(refill, MR_POOL * MR_POOL_BYTES // length)


def _next_mr_refill(last: int, length: int) -> int:
    """How many MRs of length the refill after one of last asks for, if that one got all it asked for."""
    return _mr_pool_want(_grown(last, MR_POOL_GROWTH, MR_POOL_MAX), length)


def mr_pool_refills(length: int, count: int) -> list[int]:
    """The reg_mrs sizes that serve count MR()s of length one after another on a new context, none refused: what
    a guest's loop of small MRs costs vrnicd (bench.mediation_floor replays it on a bare mediator)."""
    return _refills(count, _mr_pool_want(MR_POOL, length), lambda last: _next_mr_refill(last, length))


def _grown(refill: int, factor: int, cap: int) -> int:
    """A pool's next refill after one of refill: factor times as many, up to cap."""
    return min(factor * refill, cap)


def _refills(count: int, first: int, after: Callable[[int], int]) -> list[int]:
    """The refill sizes, first then after(last) each time, that serve count handouts of one shape on a new context."""
    sizes = [first]
    while sum(sizes) < count:
        sizes.append(after(sizes[-1]))
    return sizes


def _pool_buffers(ctx: Context, size: int, count: int) -> list[Buffer]:
    """Buffers of size for a pool: count side by side if the arena has them in one piece (one search, not one per
    buffer: a 50-MR loop's four refills spent 1.4-3.2 ms in the arena in the lab, issue 14); else the first one,
    or the arena's error, then as many as the arena has room for (a spare is not made rather than make room)."""
    align = _mr_align(size)
    with contextlib.suppress(VrnicError):
        return ctx.alloc_many([size] * count, align, spare=True)
    buffers = [ctx.alloc(size, align)]
    while len(buffers) < count:
        try:
            buffers.append(ctx.alloc(size, align, spare=True))
        except VrnicError:  # the arena is short: fewer spares
            break
    return buffers


def _mr_align(size: int) -> int:
    """The alignment that keeps an MR's buffer of size on as few pages as it can be (each page an MR spans is one
    more for the NIC to pin): a power of two no smaller than size, up to a page, and 64 at least (a cache line)."""
    return max(64, min(PAGE, 1 << (size - 1).bit_length()))


def _give_back_spare_mrs(ctx: Context, on_pd: int | None = None) -> int:
    """Deregister the context's spare MRs, and free the buffers prepared for their pools' next refills: those on
    PD on_pd (it is being closed), or all of them (the quota or the arena needs the room); how many MRs there
    were."""
    given: list[SpareMr] = []
    for shape, spares in ctx.spare_mrs.items():
        if on_pd is None or shape.pd == on_pd:
            given += spares
            spares.clear()
    _free_prepared_buffers(ctx, on_pd)
    _teardown(ctx, given, "dereg_mrs", "dereg_mr", "mr", lambda spare: ctx.free(spare.buffer))
    return len(given)


def _free_prepared_buffers(ctx: Context, on_pd: int | None = None) -> int:
    """Free the buffers prepared for the next refills of MR pools on PD on_pd, or of all; how many there were."""
    freed = 0
    for shape in [shape for shape in ctx.next_mr_buffers if on_pd is None or shape.pd == on_pd]:
        prepared = ctx.next_mr_buffers.pop(shape)
        _free_all(ctx, prepared)
        freed += len(prepared)
    return freed


class CQ(_Resource):
    """A completion queue. On the shared-ring engine it is handed out from the context's pool of CQs of its size
    (pre-setup, as PDs are): vrnicd creates up to CQ_POOL of them in one request (within the quota, which they
    count against), and a CQ closed here goes back to the pool, with what it still held discarded as destroying
    a CQ discards it. When the quota refuses CQs of a new size, the spare CQs of other sizes are given back
    first. On the direct engine a CQ is the NIC's own, created and destroyed by a round trip each."""

    def __init__(self, ctx: Context, cqe: int = 64) -> None:
        self.ctx = ctx
        self.cqe = cqe
        self.users = 0  # QPs using it: as vrnicd does, a CQ in use is not given up
        self.direct: DirectCq | None = None
        ctx.open_channel()
        if ctx.direct is not None:  # the NIC's own CQ, mapped here
            reply = ctx.call("create_cq", cqe=cqe)
            self.handle = int(reply["cq"])
            try:
                self.direct = DirectCq(ctx.direct, reply)
            except BaseException:
                ctx.call("destroy_cq", cq=self.handle)
                raise
            return
        spares = ctx.spare_cqs.setdefault(cqe, [])
        if not spares:
            spares += _create_cqs(ctx, cqe)[::-1]
        self.handle, self.ring_buffer = spares.pop()
        self.ring = Ring(ctx.view, self.ring_buffer.offset, cqe, CQ_SLOT, ctx.words)

    def poll(self, max_entries: int = 16) -> list[Completion]:
        """Completions waiting in the shared ring (or the NIC's CQ); never a round trip to vrnicd."""
        if self.direct is not None:
            return self.direct.poll(max_entries)
        if self.ring.flags & RingFlags.OVERFLOW:
            raise DeviceError("CQ overflow: completions were lost", errno.EOVERFLOW)
        if self.ring.flags & RingFlags.CORRUPT:
            raise DeviceError("the CQ ring was corrupted; vrnicd stopped it", errno.EIO)
        if self.ring.flags & RingFlags.FAILED:
            raise DeviceError("vrnicd's data path for this vRNIC failed; the session is closed", errno.EIO)
        return [unpack_completion(slot) for slot in self.ring.consume(max_entries)]

    def wait(self, count: int = 1, timeout: float = 10.0, spin: int = 20) -> list[Completion]:
        """Poll until count completions arrived: a few busy polls, then sleep until vrnicd rings."""
        if self.direct is not None:  # the NIC often finished inside the doorbell already: look once, cheaply
            done: list[Completion] = self.direct.poll(count)
            if len(done) == count:
                return done
        else:
            done = []
        deadline = time.monotonic() + timeout
        spins = 0
        notify = None if self.direct is not None else self.ctx.notify_fd
        spin_until = time.monotonic() + DIRECT_SPIN_S if self.direct is not None else 0.0
        while len(done) < count:
            got = self.poll(count - len(done))
            done += got
            if got:
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeviceError(f"{len(done)} of {count} completions within {timeout} s", errno.ETIMEDOUT)
            spins += 1
            if spins <= spin:
                continue
            if self.direct is not None:  # nobody rings for the NIC's CQ: poll, briefly spinning first
                if time.monotonic() > spin_until:
                    time.sleep(DIRECT_POLL_SLEEP_S)
            elif notify is None:
                time.sleep(VM_POLL_SLEEP_S)
            # The ring is re-checked after every wake-up, so a stale notification costs one loop. poll(2), as a
            # program with many descriptors may hold this one past select(2)'s 1024.
            elif _readable(notify, min(left, 0.05)):
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(notify)
        return done

    def close(self) -> None:
        if self.closed:
            return
        if self.users:
            raise Conflict(f"CQ {self.handle} is still used by {self.users} QP(s)", current_state="in_use")
        if not self.ctx.closed:
            if self.direct is None and self._reusable():
                self.ring.consume(self.ring.entries)  # what it still held goes, as with a destroyed CQ
                self.ctx.spare_cqs.setdefault(self.cqe, []).append((self.handle, self.ring_buffer))
            else:
                _give_back_spare_qps(self.ctx, on_cq=self.handle)
                self.ctx.call("destroy_cq", cq=self.handle)
                if self.direct is not None:
                    self.direct.close()
                else:
                    self.ctx.free(self.ring_buffer)
        self.closed = True

    def _reusable(self) -> bool:
        """Whether the pool may hand this CQ out again: its ring is sound and not full. vrnicd moves every
        completion of a destroyed QP into the ring before destroy_qp returns, so with no QP left on the CQ
        nothing arrives later; only a full ring may have left some with the NIC."""
        try:
            return not self.ring.flags & (RingFlags.OVERFLOW | RingFlags.CORRUPT | RingFlags.FAILED) \
                and self.ring.count() < self.ring.entries
        except RingCorrupt:
            return False


def _create_cqs(ctx: Context, cqe: int) -> list[tuple[int, Buffer]]:
    """New CQs of cqe entries with their rings: up to CQ_POOL in one create_cqs, as many as the arena and the
    quota allow (at least one). When the quota refuses, the spare CQs of other sizes are given back and the
    request is made once more."""
    size = Ring.bytes_needed(cqe, CQ_SLOT.size)
    rings = _pool_buffers(ctx, size, CQ_POOL if size <= CQ_POOL_RING_BYTES else 1)
    try:
        request = {"cqe": cqe, "rings": [ring.addr for ring in rings]}
        try:
            handles = [int(h) for h in ctx.call("create_cqs", **request)["cqs"]]
        except QuotaExceeded as exc:
            if exc.limit != "max_cqs" or not _give_back_spare_cqs(ctx):
                raise
            handles = [int(h) for h in ctx.call("create_cqs", **request)["cqs"]]
    except BaseException:
        for ring in rings:
            ctx.free(ring)
        raise
    for ring in rings[len(handles):]:
        ctx.free(ring)
    return list(zip(handles, rings[:len(handles)], strict=True))


def _give_back_spare_cqs(ctx: Context) -> int:
    """Destroy the context's spare CQs (the quota needs the room); how many there were."""
    given = 0
    for spares in ctx.spare_cqs.values():
        while spares:
            handle, ring = spares.pop()
            _give_back_spare_qps(ctx, on_cq=handle)
            ctx.call("destroy_cq", cq=handle)
            ctx.free(ring)
            given += 1
    return given


class QpShape(NamedTuple):
    """What a create_qp asks for; QPs of one shape are interchangeable before they are handed out (a tuple, as
    MrShape)."""
    pd: int
    send_cq: int
    recv_cq: int
    qp_type: str
    max_send_wr: int
    max_recv_wr: int
    max_sge: int

    def ring_bytes(self) -> tuple[int, int]:
        return Ring.bytes_needed(self.max_send_wr, SQ_SLOT.size), Ring.bytes_needed(self.max_recv_wr, RQ_SLOT.size)

    def request(self, rings: tuple[Buffer, Buffer] | None) -> dict[str, Any]:
        args: dict[str, Any] = {"pd": self.pd, "send_cq": self.send_cq, "recv_cq": self.recv_cq,
                                "qp_type": self.qp_type, "max_send_wr": self.max_send_wr,
                                "max_recv_wr": self.max_recv_wr, "max_sge": self.max_sge}
        if rings is not None:
            args.update(sq_ring=rings[0].addr, rq_ring=rings[1].addr)
        return args


class SpareQp(NamedTuple):
    """A QP vrnicd created (in RESET) for the context's pool: its handle, virtual QPN and rings."""
    handle: int
    qpn: int
    rings: tuple[Buffer, Buffer] | None  # None on the direct engine
    reply: dict[str, Any]  # on the direct engine, where the NIC's queues are


def _create_qps(ctx: Context, shape: QpShape, count: int, fewer: bool = False) -> list[SpareQp]:
    """count new QPs of one shape in one request, with their rings on the shared-ring engine: all of them or
    none; with fewer, as many as the arena has room for (at least one)."""
    rings: list[tuple[Buffer, Buffer]] = []
    try:
        if ctx.direct is None and count > 1:  # the shared-ring engine: the rings live in the arena, side by side
            with contextlib.suppress(QuotaExceeded):  # the arena has no room for all: one pair at a time, below
                buffers = ctx.alloc_many(list(shape.ring_bytes()) * count)
                rings = list(zip(buffers[0::2], buffers[1::2], strict=True))
        if ctx.direct is None:
            while len(rings) < count:
                try:
                    rings.append(_ring_pair(ctx, shape))
                except VrnicError:  # the arena is short
                    if not fewer or not rings:
                        raise
                    break
        made = len(rings) or count
        if made == 1 or not ctx.shape_batches:  # the plain verb (every vrnicd), or items (one before the shape)
            replies = ([ctx.call("create_qp", **shape.request(rings[0] if rings else None))] if made == 1 else
                       ctx.call("create_qps", qps=[shape.request(rings[i] if rings else None)
                                                   for i in range(made)])["qps"])
            return [SpareQp(int(reply["qp"]), int(reply["qpn"]), rings[i] if rings else None, reply)
                    for i, reply in enumerate(replies)]
        # One shape, and the rings' addresses: checked once by vrnicd and small on the wire
        result = ctx.call("create_qps", shape=shape.request(None), count=made,
                          **({"rings": [b.addr for pair in rings for b in pair]} if rings else {}))
        handles, qpns = result["qps"], result["qpns"]
        queues = result.get("queues")  # the direct engine's: where each QP's NIC queues are, as create_qp says
        if not len(handles) == len(qpns) == made or (queues is not None and len(queues) != made):
            raise VrnicError(f"vrnicd answered create_qps for {made} QPs with {len(handles)}")
        return [SpareQp(int(handles[i]), int(qpns[i]), rings[i] if rings else None,
                        {} if queues is None else {"qp": handles[i], "qpn": qpns[i], **queues[i]})
                for i in range(made)]
    except BaseException:
        for pair in rings:
            for buffer in pair:
                ctx.free(buffer)
        raise


def _ring_pair(ctx: Context, shape: QpShape) -> tuple[Buffer, Buffer]:
    """A QP's send and receive rings in the arena: both, or neither."""
    sq_bytes, rq_bytes = shape.ring_bytes()
    sq = ctx.alloc(sq_bytes)
    try:
        return sq, ctx.alloc(rq_bytes)
    except BaseException:
        ctx.free(sq)
        raise


def _pooled_qp(ctx: Context, shape: QpShape) -> SpareQp:
    """A QP of this shape from the context's pool, which one create_qps fills: with QP_POOL QPs at first, twice
    as many at each later refill, up to QP_POOL_MAX. When the quota refuses, the spare QPs of every shape are given
    back, one QP is asked for alone, and the next refill is QP_POOL again."""
    spares = ctx.spare_qps.setdefault(shape, [])
    if not spares:
        want = ctx.qp_refill.get(shape, QP_POOL)
        try:
            made = _create_qps(ctx, shape, want, fewer=True)
            ctx.qp_refill[shape] = _grown(want, QP_POOL_GROWTH, QP_POOL_MAX)
        except QuotaExceeded as exc:
            if exc.limit != "max_qps":
                raise
            ctx.qp_refill[shape] = QP_POOL
            _give_back_spare_qps(ctx)
            made = _create_qps(ctx, shape, 1)
        spares += made[::-1]
    return spares.pop()


def qp_pool_refills(count: int) -> list[int]:
    """The create_qps sizes that serve count QP()s of one shape one after another on a new context, none refused:
    what a guest's loop of QPs costs vrnicd (bench.mediation_floor replays it on a bare mediator)."""
    return _refills(count, QP_POOL, lambda last: _grown(last, QP_POOL_GROWTH, QP_POOL_MAX))


def _give_back_spare_qps(ctx: Context, on_cq: int | None = None) -> None:
    """Destroy the context's spare QPs: those on CQ on_cq (it is going), or all of them (the quota needs the
    room)."""
    given: list[SpareQp] = []
    for shape, spares in ctx.spare_qps.items():
        if on_cq in (None, shape.send_cq, shape.recv_cq):
            given += spares
            spares.clear()

    def forget(spare: SpareQp) -> None:  # its rings go back to the arena once vrnicd let go of it
        for buffer in spare.rings or ():
            ctx.free(buffer)

    _teardown(ctx, given, "destroy_qps", "destroy_qp", "qp", forget)


class QP(_Resource):
    pd: PD
    send_cq: CQ
    recv_cq: CQ
    qp_type: str
    direct: DirectQp | None
    handle: int
    qpn: int  # virtual: what a peer names this QP by
    sq_buffer: Buffer  # the shared-ring engine's rings, in the arena
    rq_buffer: Buffer
    sq: Ring
    rq: Ring

    def __init__(self, pd: PD, send_cq: CQ, recv_cq: CQ, qp_type: str = "rc", max_send_wr: int = 64,
                 max_recv_wr: int = 64, max_sge: int = 1) -> None:
        """A QP in RESET. On the shared-ring engine it is handed out from the context's pool of QPs of its shape
        (pre-setup, as PDs and CQs are): vrnicd creates QP_POOL of them in one request, and twice as many at each
        later refill of that shape (up to QP_POOL_MAX). They count against the quota; when it has no room for a
        refill, one QP is made at a time. A closed QP is destroyed, never handed
        out again, so every QP is a new one."""
        ctx = pd.ctx
        shape = QpShape(pd.handle, send_cq.handle, recv_cq.handle, qp_type, max_send_wr, max_recv_wr, max_sge)
        ctx.open_channel()
        spares = ctx.spare_qps.get(shape)
        if spares:  # a handout: only a pooled shape has spares
            made = spares.pop()
        elif ctx.direct is None and sum(shape.ring_bytes()) <= QP_POOL_RING_BYTES:
            made = _pooled_qp(ctx, shape)
        else:
            (made,) = _create_qps(ctx, shape, 1)
        self._take(pd, send_cq, recv_cq, shape, made)

    @classmethod
    def create_many(cls, pd: PD, send_cq: CQ, recv_cq: CQ, count: int, qp_type: str = "rc", max_send_wr: int = 64,
                    max_recv_wr: int = 64, max_sge: int = 1) -> list[QP]:
        """count QPs of one shape in one round trip to vrnicd (create_qps): all of them, or none."""
        shape = QpShape(pd.handle, send_cq.handle, recv_cq.handle, qp_type, max_send_wr, max_recv_wr, max_sge)
        made = _create_qps(pd.ctx, shape, count)
        qps: list[QP] = []
        for index, spare in enumerate(made):
            qp = cls.__new__(cls)
            try:
                qp._take(pd, send_cq, recv_cq, shape, spare)
            except BaseException:
                for left in made[index + 1:]:
                    pd.ctx.call("destroy_qp", qp=left.handle)
                for done in qps:
                    done.close()
                raise
            qps.append(qp)
        return qps

    def _take(self, pd: PD, send_cq: CQ, recv_cq: CQ, shape: QpShape, made: SpareQp) -> None:
        """Become the QP vrnicd made; on the direct engine its NIC queues are mapped here (destroyed if not)."""
        ctx = pd.ctx
        self.pd, self.send_cq, self.recv_cq, self.qp_type, self.direct = pd, send_cq, recv_cq, shape.qp_type, None
        self.handle, self.qpn = made.handle, made.qpn
        if ctx.direct is not None:  # the NIC's own queues, mapped here
            try:
                self.direct = DirectQp(ctx.direct, made.handle, made.reply)
            except BaseException:
                ctx.call("destroy_qp", qp=made.handle)
                raise
        elif made.rings is not None:  # the shared-ring engine's rings, always there on it
            self.sq_buffer, self.rq_buffer = made.rings
            self.sq = Ring(ctx.view, self.sq_buffer.offset, shape.max_send_wr, SQ_SLOT, ctx.words)
            self.rq = Ring(ctx.view, self.rq_buffer.offset, shape.max_recv_wr, RQ_SLOT, ctx.words)
        pd.users += 1
        send_cq.users += 1
        recv_cq.users += 1

    def connect(self, remote_gid: str, remote_qpn: int, access: int = 15) -> None:
        """INIT -> RTR -> RTS towards a peer named by its virtual GID and virtual QPN."""
        self.pd.ctx.call("connect", qp=self.handle, remote_gid=remote_gid, remote_qpn=remote_qpn, access=access)

    @staticmethod
    def connect_many(ctx: Context, connections: Iterable[tuple[QP, str, int]], access: int = 15) -> None:
        """connect for each (QP, remote GID, remote QPN), in one round trip (connect_qps): all, or none."""
        connections = list(connections)
        gids = {gid for _, gid, _ in connections}
        if len(gids) == 1 and ctx.shape_batches:  # towards one peer: its GID once, and two lists of numbers
            ctx.call("connect_qps", remote_gid=gids.pop(), access=access, qps=[qp.handle for qp, _, _ in connections],
                     remote_qpns=[qpn for _, _, qpn in connections])
            return
        ctx.call("connect_qps", connections=[{"qp": qp.handle, "remote_gid": gid, "remote_qpn": qpn,
                                              "access": access} for qp, gid, qpn in connections])

    def modify(self, state: str, **attrs: Any) -> None:
        self.pd.ctx.call("modify_qp", qp=self.handle, state=state, **attrs)

    def query(self) -> dict[str, Any]:
        return self.pd.ctx.call("query_qp", qp=self.handle)

    def post_send(self, wrs: SendRequest | Iterable[SendRequest], doorbell: bool = True) -> None:
        """Write the WRs into the shared send ring, then ring the doorbell once (batching)."""
        if self.direct is not None:
            self.direct.post_send([wrs] if isinstance(wrs, SendRequest) else list(wrs), doorbell)
            return
        for wr in [wrs] if isinstance(wrs, SendRequest) else wrs:
            if not self.sq.produce(pack_send(wr)):
                raise DeviceError("send queue full", errno.ENOMEM)
        if doorbell:
            self.pd.ctx.ring_doorbell()

    def post_recv(self, wrs: RecvRequest | Iterable[RecvRequest], doorbell: bool = True,
                  sync: bool = False) -> None:
        """Queue receives. vrnicd hands them to the NIC asynchronously; RC's RNR retry covers the
        gap, but a UD receiver that must be ready before its peer sends passes sync=True, which
        returns only once the NIC holds them (one round trip to vrnicd). On the direct engine a receive
        is in the NIC's queue when this returns."""
        if self.direct is not None:
            self.direct.post_recv([wrs] if isinstance(wrs, RecvRequest) else list(wrs))
            return
        for wr in [wrs] if isinstance(wrs, RecvRequest) else wrs:
            if not self.rq.produce(pack_recv(wr)):
                raise DeviceError("receive queue full", errno.ENOMEM)
        if sync:
            self.pd.ctx.call("sync")
        elif doorbell:
            self.pd.ctx.ring_doorbell()

    def close(self) -> None:
        QP.close_many((self,))

    @staticmethod
    def close_many(qps: Iterable[QP]) -> None:
        """close() of each QP, in one destroy_qps per context (up to MAX_BATCH QPs a request)."""
        for ctx, group in _open_by_context(qps):
            _teardown(ctx, group, "destroy_qps", "destroy_qp", "qp", QP._forget)

    def _forget(self) -> None:
        """What this process holds for the QP, once vrnicd destroyed it (or the context closed)."""
        if not self.closed:
            if not self.pd.ctx.closed:
                if self.direct is not None:
                    self.direct.close()
                else:
                    self.pd.ctx.free(self.sq_buffer)
                    self.pd.ctx.free(self.rq_buffer)
            self.pd.users -= 1
            self.send_cq.users -= 1
            self.recv_cq.users -= 1
        self.closed = True


_Closable = TypeVar("_Closable", QP, MR)


class _HasHandle(Protocol):
    @property
    def handle(self) -> int: ...


_Handled = TypeVar("_Handled", bound=_HasHandle)  # an MR or QP, or a pool's spare one


def _open_by_context(objects: Iterable[_Closable]) -> list[tuple[Context, list[_Closable]]]:
    """The objects not closed yet (each once), grouped by their live context; those of a closed context are
    forgotten here, as close() does."""
    groups: dict[int, tuple[Context, list[_Closable]]] = {}
    for obj in dict.fromkeys(objects):
        if obj.closed:
            continue
        ctx = obj.pd.ctx
        if ctx.closed:
            obj._forget()
            continue
        groups.setdefault(id(ctx), (ctx, []))[1].append(obj)
    return list(groups.values())


def _teardown(ctx: Context, objects: Sequence[_Handled], batch_op: str, op: str, field: str,
              forget: Callable[[_Handled], None]) -> None:
    """Deregister or destroy these objects in vrnicd, then forget() each here: batch_op (dereg_mrs, destroy_qps)
    for up to MAX_BATCH at a time, or op (dereg_mr, destroy_qp) for each with a vrnicd that has no batch_op.

    A DeviceError is the NIC refusing to destroy an object: vrnicd has dropped every object of that request all
    the same (their handles are gone), so they are forgotten here too, the rest are still sent, and the first such
    error is raised at the end. Any other error (the request refused: nothing went) is raised at once."""
    size = MAX_BATCH if ctx.teardown_batches and len(objects) > 1 else 1
    first: DeviceError | None = None
    for start in range(0, len(objects), size):
        group = objects[start:start + size]
        try:
            if size > 1:
                ctx.call(batch_op, **{f"{field}s": [obj.handle for obj in group]})
            else:
                ctx.call(op, **{field: group[0].handle})
        except DeviceError as exc:
            first = first or exc
        for obj in group:
            forget(obj)
    if first is not None:
        raise first

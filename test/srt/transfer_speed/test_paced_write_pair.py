"""Prefill's KV write waits without spinning and keeps upstream's contract (disaggregation/fork_transfer/paced_write.py),
over real mooncake TCP on 127.0.0.1: a sink process holds registered memory; this process writes into it through an
upstream `MooncakeTransferEngine` whose `batch_transfer_sync` is swapped as the fork swaps it on prefill.

- a write lands the same bytes as upstream's synchronous write, and answers 0; a small one (a request's metadata)
  answers within a fraction of the poll (its first waits are short);
- a failed write (an address the peer never registered, a peer that is gone, lists that do not match) answers what
  upstream's answers, as fast;
- a write to a frozen peer ends -1 on mooncake's own wall-clock bound, as upstream's does, while the waiting thread
  uses a small fraction of one core (upstream's spins the whole time); the blocks it left running are freed later;
- a knob of 0 takes upstream's write; through sglang's real send path (a MooncakePair) the swap is in place and the KV
  lands byte-identical;
- through the same path, the transfer worker that concluded a room sets the wake prefill's idle pacer waits on
  (idle_pacing), once per room, so the scheduler sees the room's status at once rather than a pace later.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import random
import signal
import time
from typing import Any, Callable, List, Optional

import pytest

from sglang.srt.disaggregation.fork_transfer import paced_write
from testing.pd_checks import pair_fixture

pytestmark = pytest.mark.pair

SINK_BYTES = 64 << 20
BLOCKS = 8
# mooncake's bound of a synchronous write (read when an engine is built; its minimum): a frozen peer's write ends
# after this plus 1 ns a byte. The bounds below add 3 s of margin for a loaded 2-core machine.
MC_TIMEOUT_S = 5
POLL = 0.0005


def _sink(conn: Any) -> None:
    """Child: a mooncake engine with SINK_BYTES registered; answers reads and clears until told to stop."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    memory = ctypes.create_string_buffer(SINK_BYTES)
    assert engine.register_memory(ctypes.addressof(memory), SINK_BYTES) == 0
    conn.send((f"127.0.0.1:{engine.get_rpc_port()}", ctypes.addressof(memory)))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg[0] == "read":
            conn.send(ctypes.string_at(ctypes.addressof(memory) + msg[1], msg[2]))
        elif msg[0] == "clear":
            ctypes.memset(memory, 0, SINK_BYTES)
            conn.send(None)


class Sink:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_sink, args=(child,), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "the sink did not start"
        self.session, self.base = self.conn.recv()

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        assert self.conn.poll(30)
        return self.conn.recv()

    def close(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def sink():
    s = Sink()
    yield s
    s.close()


@pytest.fixture(scope="module")
def source():
    """This process's side: a registered source buffer of random bytes, and a maker of upstream engines (each built
    with mooncake's bound at MC_TIMEOUT_S, as an operator's MC_TRANSFER_TIMEOUT sets it)."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine

    data = random.Random(7).randbytes(SINK_BYTES)
    buffer = ctypes.create_string_buffer(data, SINK_BYTES)
    engines = []

    def engine(poll: Optional[float], spy: Optional[List[tuple]] = None):
        old = os.environ.get("MC_TRANSFER_TIMEOUT")
        os.environ["MC_TRANSFER_TIMEOUT"] = str(MC_TIMEOUT_S)
        try:
            wrapper = MooncakeTransferEngine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
            if poll is not None:
                if spy is not None:  # record each call of upstream's write (the real one runs)
                    upstream_write = wrapper.batch_transfer_sync

                    def recorded(*args):
                        spy.append(args)
                        return upstream_write(*args)

                    wrapper.batch_transfer_sync = recorded
                assert isinstance(paced_write.pace(wrapper, poll), paced_write.PacedWrite)
        finally:
            if old is None:
                os.environ.pop("MC_TRANSFER_TIMEOUT")
            else:
                os.environ["MC_TRANSFER_TIMEOUT"] = old
        wrapper.register(ctypes.addressof(buffer), SINK_BYTES)
        engines.append(wrapper)
        return wrapper

    yield ctypes.addressof(buffer), data, engine


def _scattered(src: int, dst: int, total: int = SINK_BYTES, blocks: int = BLOCKS):
    """`blocks` blocks of the source written to the sink's memory in reverse order (non-contiguous pairs)."""
    size = total // blocks
    order = list(reversed(range(blocks)))
    return ([src + i * size for i in range(blocks)], [dst + j * size for j in order], [size] * blocks, order, size)


def _expected(data: bytes, order: List[int], size: int) -> bytes:
    out = bytearray(len(order) * size)
    for i, j in enumerate(order):
        out[j * size:(j + 1) * size] = data[i * size:(i + 1) * size]
    return bytes(out)


def _timed(call: Callable[[], int]):
    """(answer, wall s, CPU s of this thread): mooncake's synchronous wait polls on the calling thread."""
    wall, cpu = time.monotonic(), time.thread_time()
    rc = call()
    return rc, time.monotonic() - wall, time.thread_time() - cpu


def test_write_lands_the_bytes_upstream_lands(sink, source):
    src, data, engine = source
    paced, upstream = engine(POLL), engine(None)
    assert isinstance(paced.batch_transfer_sync, paced_write.PacedWrite)
    buffers, peers, lengths, order, size = _scattered(src, sink.base)
    expected = _expected(data, order, size)
    for write in (paced.batch_transfer_sync, upstream.batch_transfer_sync):
        sink.call("clear")
        assert write(sink.session, buffers, peers, lengths) == 0
        assert sink.call("read", 0, SINK_BYTES) == expected
    # one block, and blocks of odd sizes and offsets
    sink.call("clear")
    assert paced.batch_transfer_sync(sink.session, [src + 3], [sink.base + 1001], [4093]) == 0
    assert sink.call("read", 1001, 4093) == data[3:4096]
    assert paced.batch_transfer_sync.leftovers() == 0



def test_a_small_write_is_not_held_a_whole_poll(sink, source):
    """A request's metadata write (a few blocks of a few bytes, done in about 0.1 ms) answers long before one poll:
    the write's first waits are an eighth of the poll, doubling. With a poll of 0.4 s the first check comes after
    50 ms and the second 100 ms later; a write that waited a whole poll before its second check would take 0.4 s."""
    src, _, engine = source
    poll = 0.4
    paced = engine(poll)
    blocks = 12
    answers = [_timed(lambda: paced.batch_transfer_sync(sink.session, [src + 64 * i for i in range(blocks)],
                                                        [sink.base + 64 * i for i in range(blocks)], [64] * blocks))
               for _ in range(3)]
    assert [rc for rc, _, _ in answers] == [0, 0, 0]
    # bound: the first two waits (0.15 s) plus 0.1 s of margin for a loaded machine, below one poll
    assert min(wall for _, wall, _ in answers) < 0.25, answers

def test_failed_writes_answer_as_upstream(sink, source):
    src, _, engine = source
    spy: List[tuple] = []
    paced, upstream = engine(POLL, spy), engine(None)
    good = _scattered(src, sink.base)[:3]
    cases = {
        # the peer rejects an address it never registered (mooncake: WRITE rejected by server)
        "unregistered peer address": (sink.session, good[0], [12345] * BLOCKS, good[2]),
        # the peer's address has nothing listening (its engine is gone)
        "peer gone": ("127.0.0.1:1", *good),
        "lists that do not match": (sink.session, good[0], good[1][:-1], good[2]),
        "nothing to write": (sink.session, [], [], []),
    }
    for name, args in cases.items():
        want = upstream.batch_transfer_sync(*args)
        rc, wall, _ = _timed(lambda: paced.batch_transfer_sync(*args))
        assert rc == want, (name, rc, want)
        assert wall < 3.0, (name, wall)  # upstream's answers come in milliseconds; a paced wait would show here
    assert [a[0] for a in spy] == ["127.0.0.1:1", sink.session, sink.session], \
        "only a block mooncake refused to submit, and the lists it cannot pace, go through upstream's write"
    assert paced.batch_transfer_sync(sink.session, *good) == 0  # the engine still writes
    spy.clear()
    assert paced.batch_transfer_sync(sink.session, *good) == 0
    assert spy == []  # a write that submits takes the paced path


def test_knob_zero_takes_upstream_write(sink, source):
    src, data, engine = source
    spy: List[tuple] = []
    unpaced = engine(0.0, spy)
    buffers, peers, lengths, order, size = _scattered(src, sink.base)
    sink.call("clear")
    assert unpaced.batch_transfer_sync(sink.session, buffers, peers, lengths) == 0
    assert len(spy) == 1 and spy[0][1] == buffers
    assert sink.call("read", 0, SINK_BYTES) == _expected(data, order, size)


def test_frozen_peer_ends_on_mooncakes_bound_without_spinning(sink, source):
    """The stall the paced write removes: upstream's write to a frozen peer spins the calling thread until mooncake's
    bound; the paced one ends at the same bound, with the same -1, nearly idle."""
    src, _, engine = source
    paced, upstream = engine(POLL), engine(None)
    args = (sink.session, *_scattered(src, sink.base)[:3])
    bound = MC_TIMEOUT_S + SINK_BYTES * 1e-9
    for write in (paced.batch_transfer_sync, upstream.batch_transfer_sync):  # both sessions open, as in a server
        assert write(*args) == 0  # (opening a frozen peer's segment waits for mooncake's handshake timeout, ~60 s)
    os.kill(sink.proc.pid, signal.SIGSTOP)
    try:
        results = {name: _timed(lambda w=w: w(*args))
                   for name, w in (("paced", paced.batch_transfer_sync), ("upstream", upstream.batch_transfer_sync))}
    finally:
        os.kill(sink.proc.pid, signal.SIGCONT)
    for name, (rc, wall, cpu) in results.items():
        assert rc == -1, (name, results)
        assert bound - 0.5 <= wall <= bound + 3.0, (name, results)
    rc, wall, cpu = results["paced"]
    # the waiting thread: one check and one sleep of POLL a round (upstream's: a whole core, cpu ~ wall)
    assert cpu < 0.25 * wall, results
    # the blocks the failed write left running end once the peer runs again; the next writes free them
    write = paced.batch_transfer_sync
    assert write.leftovers() > 0
    deadline = time.monotonic() + 30
    while write.leftovers() and time.monotonic() < deadline:
        assert write(sink.session, [src], [sink.base], [4096]) == 0
        time.sleep(0.05)
    assert write.leftovers() == 0


pair = pair_fixture(kv_tokens=2048, req_slots=4, metadata_slots=4, max_context_len=64)


def test_sglang_send_path_writes_through_the_paced_write(pair):
    """Upstream's prefill manager, built as the fork builds it: its engine's write is swapped (fork_touch checks it at
    start too), and a request's KV lands byte-identical."""
    assert pair.prefill.call("swaps_applied")[
        "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine"
        ".batch_transfer_sync <- sglang.srt.disaggregation.fork_transfer.paced_write:on_prefill_manager_init"] is True
    room = pair.submit(prompt_len=40)
    pair.run_until(lambda: pair.decode.call("transferred", room) and pair.prefill.call("status", room) == 200,
                   timeout=60)
    assert pair.decode.call("kv_bytes", room) == pair.prefill.call("kv_sent", room)


def test_a_concluded_transfer_sets_the_schedulers_wake(pair):
    """Upstream's transfer worker, once it concluded a room (Success, the status told to decode: the fork's
    chunk_failures.conclude_transfer), sets the wake the prefill scheduler's paced idle wait polls (idle_pacing), as
    the bootstrap thread did when decode's handshake for the room arrived."""
    pair.prefill.call("attach_wake")
    assert pair.prefill.call("wakes") == 0
    room = pair.submit(prompt_len=40)
    pair.run_until(lambda: pair.decode.call("transferred", room) and pair.prefill.call("status", room) == 200,
                   timeout=60)
    deadline = time.monotonic() + 10  # set right after the status went out: at most a moment after prefill's 200
    while pair.prefill.call("wakes") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # one room, one chunk: decode's handshake arriving (the bootstrap thread, idle_pacing.after_update_status) and
    # the one conclusion (the transfer worker)
    assert pair.prefill.call("wakes") == 2

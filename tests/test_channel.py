"""The data plane's channels between real processes, and the host topology's core plans."""
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from actors.channel import (Channel, ChannelClosed, PeerDied, create, native_error, segment_path,
                            sweep)
from cluster.topology import Topology, format_cpulist, parse_cpulist, plan_cores


def _echo(a, b, n, spin):
    ca, cb = Channel(a, spin_us=spin), Channel(b, writer=True, spin_us=spin)
    for _ in range(n):
        words = ca.wait()
        x = ca.view(torch.float32, (int(words[1]),))
        cb.put(x * 2)
        cb.publish(int(words[0]), int(words[1]))


def _double(a, b, n):
    ca, cb = Channel(a), Channel(b, writer=True)
    for _ in range(n):
        words = ca.wait(timeout=10)
        rows, width = int(words[2]), int(words[4])
        cb.put(ca.view(torch.float32, (rows, width)) * 2)
        cb.publish(int(words[1]), rows)


def _write_then_die(path):
    c = Channel(path, writer=True)
    time.sleep(0.3)
    os._exit(0)


@pytest.fixture
def segments():
    made = []

    def make(name, cap=1 << 16):
        p = segment_path(os.getpid(), "test", name)
        create(p, cap)
        made.append(p)
        return p
    yield make
    for p in made:
        p.unlink(missing_ok=True)


@pytest.mark.parametrize("spin", [200.0, 0.0])
def test_messages_cross_processes_in_order(segments, spin):
    a, b = segments("a"), segments("b")
    n = 300
    p = mp.get_context("spawn").Process(target=_echo, args=(a, b, n, spin))
    p.start()
    ca, cb = Channel(a, writer=True, spin_us=spin), Channel(b, spin_us=spin)
    for i in range(n):
        k = 1 + i % 500
        ca.put(torch.arange(k, dtype=torch.float32))
        ca.publish(i, k)
        words = cb.wait(timeout=10)
        assert int(words[0]) == i and int(words[1]) == k
        assert torch.equal(cb.view(torch.float32, (k,)), torch.arange(k, dtype=torch.float32) * 2)
    p.join(10)
    assert p.exitcode == 0


def _ring_writer(name, n, gap):
    from actors.tokens import TokenRing
    ring = TokenRing.open(name)
    for i in range(n):
        time.sleep(gap)
        last = i == n - 1
        ring.append({"text": str(i), "token": i, "finish_reason": "length" if last else None,
                     "at": time.monotonic()})


def _wakes() -> int:
    """This thread's voluntary context switches so far (each sleep it woke from)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


@pytest.mark.parametrize("interval", [0.0, 0.06])
def test_a_token_rings_reader_gathers_asleep(interval):
    # a request's events through a token ring from another process, 40 events 10 ms apart: in
    # order, none lost. Without an interval each comes as its own list; with one the reader sends
    # a list at most once per interval, the first at once and the last as soon as it is written
    # (the writer wakes the reader for it), and it sleeps out the interval between lists: it
    # wakes about once a list, not once an event
    from actors.tokens import TokenRing
    n, gap = 40, 0.01
    ring = TokenRing.create()
    p = mp.get_context("spawn").Process(target=_ring_writer, args=(str(ring.path), n, gap))
    try:
        p.start()
        got, w0 = [], 0
        for batch in ring.events(lambda: not p.is_alive(), interval):
            got.append((time.monotonic(), batch))
            w0 = w0 or _wakes()  # (from the first list: the writer's start aside)
        wakes = _wakes() - w0
        p.join(10)
        assert p.exitcode == 0
    finally:
        ring.close()
    assert [e["token"] for _, b in got for e in b] == list(range(n))
    if not interval:
        assert all(len(b) == 1 for _, b in got)
        assert wakes >= n - 3, wakes
        return
    assert len(got) < n / 3, [len(b) for _, b in got]
    assert len(got[0][1]) <= 2  # the first at once
    gaps = [b[0] - a[0] for a, b in zip(got, got[1:-1])]
    assert all(g >= interval * 0.95 for g in gaps), gaps
    t_last, batch = got[-1]
    assert t_last - batch[-1]["at"] < interval / 2, t_last - batch[-1]["at"]
    assert wakes <= len(got) + 4, (wakes, len(got))


def test_reader_learns_the_writer_died(segments):
    a = segments("a")
    p = mp.get_context("spawn").Process(target=_write_then_die, args=(a,))
    p.start()
    c = Channel(a)
    t0 = time.perf_counter()
    with pytest.raises(PeerDied, match="died"):
        c.wait(timeout=30)
    assert time.perf_counter() - t0 < 10
    p.join()


def test_close_wakes_a_waiting_reader_and_timeouts_name_the_channel(segments):
    a = segments("a")
    w, r = Channel(a, writer=True), Channel(a)
    with pytest.raises(TimeoutError, match="test-a"):
        r.wait(timeout=0.2)
    w.close_all()
    with pytest.raises(ChannelClosed):
        r.wait(timeout=5)


def test_native_ops_speak_the_channel_protocol(segments):
    # the compiled step's ends (ch_send, ch_recv) against Python's on the other side: words,
    # payloads and counts agree, with each channel named by its address or by the slot number
    # it was given (`ch_slot`, what a compiled step holds), and a dead writer, a closed channel
    # or a slot that names nothing raise what they should
    from powerinfer import kernels
    if not kernels.available():
        pytest.skip("the kernel library does not run here")
    a, b, c = segments("a"), segments("b"), segments("c")
    n = 40
    p = mp.get_context("spawn").Process(target=_double, args=(a, b, n))
    p.start()
    ca, cb = Channel(a, writer=True), Channel(b)
    torch.ops.powerinfer.ch_slot(5, ca.base)
    torch.ops.powerinfer.ch_slot(6, cb.base)
    for i in range(n):
        x = torch.randn(1 + i % 3, 4 + 4 * (i % 2))
        to, frm = (ca.base, cb.base) if i % 2 else (5, 6)
        sent = torch.ops.powerinfer.ch_send([x], to, ca.capacity, 7, i, [x.shape[1]])
        assert torch.equal(sent, x)
        y = torch.ops.powerinfer.ch_recv(x, cb.state, frm, x.shape[1], 100.0)
        assert torch.equal(y, x * 2) and int(cb._hdr[3]) == i
    assert cb.seen == n and cb.wait_s > 0
    p.join(10)
    assert p.exitcode == 0
    with pytest.raises(RuntimeError) as died:  # its writer has exited
        torch.ops.powerinfer.ch_recv(x, cb.state, cb.base, 4, 0.0)
    assert isinstance(native_error(died.value), PeerDied)
    w, r = Channel(c, writer=True), Channel(c)
    w.close_all()
    with pytest.raises(RuntimeError) as closed:
        torch.ops.powerinfer.ch_recv(x, r.state, r.base, 4, 0.0)
    assert isinstance(native_error(closed.value), ChannelClosed)
    with pytest.raises(RuntimeError, match="slot 63 names no mapping"):
        torch.ops.powerinfer.ch_recv(x, r.state, 63, 4, 0.0)
    with pytest.raises(RuntimeError, match="out of 1..63"):
        torch.ops.powerinfer.ch_slot(64, r.base)


def test_sweep_removes_only_segments_of_dead_owners(segments):
    mine = segments("kept")
    p = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    orphan = segment_path(p.pid, "test", "orphan")
    create(orphan, 64)
    removed = sweep()
    assert orphan in removed and not orphan.exists() and mine.exists()


def test_topology_and_core_plans():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist({11, 0, 2, 1, 3, 8, 10}) == "0-3,8,10-11" and format_cpulist([]) == ""
    assert format_cpulist([5]) == "5" and format_cpulist([4, 5]) == "4-5"
    real = Topology.read()
    assert set(real.cores) <= os.sched_getaffinity(0) and real.cores
    two_nodes = Topology(((0, 1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14, 15)))
    p = plan_cores(two_nodes, 1, hot_cores=2)
    assert p.hot == (0, 1) and p.cold == (tuple(range(2, 16)),)
    p = plan_cores(two_nodes, 2, hot_cores=2)  # one executor per NUMA node
    assert p.cold == ((2, 3, 4, 5, 6, 7), tuple(range(8, 16)))
    p = plan_cores(Topology(((0, 1),)), 4)  # more executors than cores: they share
    assert p.hot == (0,) and p.cold == ((1,),) * 4


def test_head_ranges_cover_the_vocabulary_once():
    from actors.plane import head_ranges
    for vocab, n, share in [(49152, 1, 0.5), (49152, 2, 1 / 3), (100, 3, 1.0), (7, 4, 0.25)]:
        r = head_ranges(vocab, n, share)
        assert len(r) == n + 1 and r[0][0] == 0 and r[-1][1] == vocab
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(r, r[1:]))
    # cold executors on the hot executor's own cores: the hot one keeps the whole head
    assert head_ranges(100, 2, 1.0) == [(0, 100), (100, 100), (100, 100)]

#!/usr/bin/python3
"""An independent client (Python grpcio, stubs generated from proto/epd.proto and the standard
health.proto) calls every RPC of a live daemon and checks the answers against each other."""
import os
import queue
import sys
import threading
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "py"))
import epdtest  # noqa: E402

epdtest.need_daemon()
epd_pb2, epd_grpc, health_pb2, health_grpc = epdtest.stubs()
import grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

V = epdtest.PROTOCOL_VERSION
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def expect_error(code, fn, *args, contains=None, **kw):
    try:
        fn(*args, timeout=10, **kw)
    except grpc.RpcError as e:
        assert e.code() == code, f"{fn}: got {e.code()} ({e.details()}), want {code}"
        if contains:
            assert contains in e.details(), f"{e.details()!r} does not contain {contains!r}"
        return e
    raise AssertionError(f"{fn} succeeded, want {code}")


class Stream:
    """Consume a server stream in a thread so every read can time out."""

    def __init__(self, call):
        self.call, self.q = call, queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            for m in self.call:
                self.q.put(m)
        except grpc.RpcError as e:
            self.q.put(e)

    def next(self, timeout=10, want=None):
        """Next message (of kind want, for events), skipping others."""
        while True:
            m = self.q.get(timeout=timeout)
            if isinstance(m, Exception):
                raise m
            if want is None or getattr(m, "kind", None) == want:
                return m


d = epdtest.Daemon(num_ranks=2)
try:
    ch = grpc.insecure_channel("unix:" + d.sock)
    grpc.channel_ready_future(ch).result(timeout=10)
    ctl = epd_grpc.ControlStub(ch)
    health = health_grpc.HealthStub(ch)

    # Health: both service names we serve, NOT_FOUND for others (health.proto).
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service="epd.v1.Control"), timeout=10).status == SERVING
    expect_error(grpc.StatusCode.NOT_FOUND, health.Check, health_pb2.HealthCheckRequest(service="no.such.Svc"))
    hwatch = Stream(health.Watch(health_pb2.HealthCheckRequest(service="epd.v1.Control"), timeout=60))
    assert hwatch.next().status == SERVING
    hunknown = Stream(health.Watch(health_pb2.HealthCheckRequest(service="no.such.Svc"), timeout=60))
    assert hunknown.next().status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

    # Watch: the initial metadata arrives once the stream is registered; events after that are ours.
    wcall = ctl.Watch(epd_pb2.WatchRequest(protocol_version=V), timeout=60)
    wcall.initial_metadata()
    watch = Stream(wcall)

    # Protocol version and argument errors.
    e = expect_error(grpc.StatusCode.FAILED_PRECONDITION, ctl.GetStatus, epd_pb2.GetStatusRequest(protocol_version=7),
                     contains="daemon speaks 1")
    assert "7" in e.details()
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ctl.Attach,
                 epd_pb2.AttachRequest(protocol_version=V, rank=99, num_experts=8, hidden=128, topk=2, max_tokens=16),
                 contains="rank")
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ctl.Attach,
                 epd_pb2.AttachRequest(protocol_version=V, rank=-1, num_experts=8, hidden=128, topk=2, max_tokens=16),
                 contains="rank")

    # Attach.
    a = ctl.Attach(epd_pb2.AttachRequest(protocol_version=V, group="g1", rank=1, num_experts=8, hidden=128, topk=2,
                                         max_tokens=16, client_name="py-client", pid=os.getpid()), timeout=10)
    assert a.client_id > 0
    assert len(a.token) == 32 and len(a.secret) == 32, (len(a.token), len(a.secret))
    assert os.path.exists(a.attach_socket), a.attach_socket
    assert a.memory == "host" and a.device == -1
    assert (a.num_ranks, a.num_experts, a.hidden, a.topk, a.max_tokens) == (2, 8, 128, 2, 16)
    assert a.slots_per_rank >= 4 and a.map_version == 1
    assert a.buffers and a.arena_bytes > 0
    for b in a.buffers:
        assert b.offset + b.bytes <= a.arena_bytes, (b, a.arena_bytes)
    ev = watch.next(want="attach")
    assert ev.client_id == a.client_id and ev.group == "g1" and ev.rank == 1, ev
    # A second attach with a different geometry for the same group is refused.
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ctl.Attach,
                 epd_pb2.AttachRequest(protocol_version=V, group="g1", rank=0, num_experts=16, hidden=128, topk=2,
                                       max_tokens=16))

    # GetStatus agrees with what we did.
    s = ctl.GetStatus(epd_pb2.GetStatusRequest(protocol_version=V), timeout=10)
    assert s.backend == "host" and s.engine_mode == "host-threads" and s.state == "ready", s
    assert s.num_ranks == 2 and len(s.ranks) == 2 and s.protocol_version == V and not s.draining
    assert [c.name for c in s.clients] == ["py-client"], s.clients
    c = s.clients[0]
    assert (c.client_id, c.group, c.rank, c.pid) == (a.client_id, "g1", 1, os.getpid()), c
    assert [g.name for g in s.groups] == ["g1"] and s.groups[0].num_experts == 8
    assert s.ranks[1].clients == 1 and s.ranks[0].clients == 0, s.ranks
    assert s.ranks[1].buffer_bytes >= a.arena_bytes, (s.ranks[1], a.arena_bytes)
    assert f"daemon.control_socket = {d.sock}" in s.config, s.config

    # GetMetrics parses as Prometheus text and matches the status.
    m = ctl.GetMetrics(epd_pb2.GetMetricsRequest(protocol_version=V), timeout=10)
    fams = {f.name: f for f in text_string_to_metric_families(m.text)}
    for name in ("epd_ops", "epd_op_errors", "epd_bytes", "epd_op_latency_seconds", "epd_clients",
                 "epd_rank_buffer_bytes", "epd_expert_tokens", "epd_peer_wait_seconds", "epd_timeouts",
                 "epd_info", "epd_draining"):
        assert name in fams, (name, sorted(fams))
    assert fams["epd_op_latency_seconds"].type == "histogram"
    assert fams["epd_clients"].samples[0].value == 1
    info = fams["epd_info"].samples[0].labels
    assert info["backend"] == "host" and info["mode"] == "host-threads", info
    rb = {smp.labels["rank"]: smp.value for smp in fams["epd_rank_buffer_bytes"].samples}
    assert rb == {"0": s.ranks[0].buffer_bytes, "1": s.ranks[1].buffer_bytes}, rb
    assert len([x for x in fams["epd_expert_tokens"].samples if x.labels["group"] == "g1"]) == 8

    # Expert map: default placement, a valid new map, invalid ones.
    em = ctl.GetExpertMap(epd_pb2.GetExpertMapRequest(protocol_version=V, group="g1"), timeout=10)
    assert em.group == "g1" and em.version == 1 and len(em.experts) == 8 and em.num_ranks == 2
    for p in em.experts:
        assert [(r.rank, r.slot) for r in p.replicas] == [(p.expert // 4, p.expert % 4)], p
    new = epd_pb2.ExpertMap(group="g1")
    new.CopyFrom(em)
    # swap experts 0 and 7 between the ranks
    new.experts[0].replicas[0].rank, new.experts[0].replicas[0].slot = 1, 3
    new.experts[7].replicas[0].rank, new.experts[7].replicas[0].slot = 0, 0
    r = ctl.SetExpertMap(epd_pb2.SetExpertMapRequest(protocol_version=V, map=new), timeout=10)
    assert r.version == 2, r
    bad = epd_pb2.ExpertMap()
    bad.CopyFrom(new)
    bad.experts[3].replicas[0].rank = 5
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ctl.SetExpertMap,
                 epd_pb2.SetExpertMapRequest(protocol_version=V, map=bad))
    bad.CopyFrom(new)
    bad.experts[2].replicas[0].slot, bad.experts[2].replicas[0].rank = 1, 0  # same (rank, slot) as expert 1
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ctl.SetExpertMap,
                 epd_pb2.SetExpertMapRequest(protocol_version=V, map=bad))
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, ctl.SetExpertMap, epd_pb2.SetExpertMapRequest(protocol_version=V),
                 contains="map")
    bad.CopyFrom(new)
    bad.group = "nosuch"
    expect_error(grpc.StatusCode.NOT_FOUND, ctl.SetExpertMap, epd_pb2.SetExpertMapRequest(protocol_version=V, map=bad))
    expect_error(grpc.StatusCode.NOT_FOUND, ctl.GetExpertMap,
                 epd_pb2.GetExpertMapRequest(protocol_version=V, group="nosuch"))

    # Detach: wrong secret, right secret, twice.
    expect_error(grpc.StatusCode.PERMISSION_DENIED, ctl.Detach,
                 epd_pb2.DetachRequest(protocol_version=V, client_id=a.client_id, secret=b"x" * 32))
    ctl.Detach(epd_pb2.DetachRequest(protocol_version=V, client_id=a.client_id, secret=a.secret), timeout=10)
    ev = watch.next(want="detach")
    assert ev.client_id == a.client_id, ev
    expect_error(grpc.StatusCode.NOT_FOUND, ctl.Detach,
                 epd_pb2.DetachRequest(protocol_version=V, client_id=a.client_id, secret=a.secret))
    assert len(ctl.GetStatus(epd_pb2.GetStatusRequest(protocol_version=V), timeout=10).clients) == 0

    # Drain: health turns NOT_SERVING (Check and Watch), attaches are refused, a drain event is sent.
    dr = ctl.Drain(epd_pb2.DrainRequest(protocol_version=V, exit=False), timeout=10)
    assert dr.clients == 0
    assert hwatch.next().status == NOT_SERVING
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == NOT_SERVING
    ev = watch.next(want="drain")
    s = ctl.GetStatus(epd_pb2.GetStatusRequest(protocol_version=V), timeout=10)
    assert s.draining and s.state == "draining", (s.draining, s.state)
    expect_error(grpc.StatusCode.UNAVAILABLE, ctl.Attach,
                 epd_pb2.AttachRequest(protocol_version=V, group="g2", rank=0, num_experts=8, hidden=128, topk=2,
                                       max_tokens=16))
    ch.close()
    rc = d.stop()
    assert rc == 0, f"epd exited {rc}:\n{d.logtext()}"
    print("ok: every Control and Health RPC answered as expected")
except BaseException:
    print(d.logtext(), file=sys.stderr)
    raise
finally:
    d.cleanup()

#!/usr/bin/python3
"""Malformed protobuf bytes on every method and a wrong protocol_version on every versioned one get a
clear error (INVALID_ARGUMENT "malformed <Method>Request", FAILED_PRECONDITION naming both versions); a
request without protocol_version (0) is served as the current version;
oversized messages and unknown methods are refused; the daemon still answers GetStatus afterwards."""
import sys
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "py"))
import epdtest  # noqa: E402

epdtest.need_daemon()
epd_pb2, epd_grpc, health_pb2, health_grpc = epdtest.stubs()
import grpc  # noqa: E402

CONTROL = ["Attach", "Detach", "GetStatus", "GetMetrics", "SetExpertMap", "GetExpertMap", "Watch", "Drain"]
STREAMING = {"Watch", "HealthWatch"}
MALFORMED = {
    "truncated varint": b"\x08\xff",
    "overlong varint": b"\x08" + b"\xff" * 11 + b"\x01",
    "length past the end": b"\x12\x05ab",
    "field number 0": b"\x00\x01",
    "wire type 7": b"\x0f\x01",
    "unterminated group": b"\x0b",
    "truncated fixed64": b"\x09\x01\x02",
    "garbage": bytes(range(255, 0, -7)),
}


def call(ch, path, payload, streaming):
    """Send raw bytes; return (code, details)."""
    try:
        if streaming:
            for _ in ch.unary_stream(path)(payload, timeout=5):
                pass
        else:
            ch.unary_unary(path)(payload, timeout=5)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def alive(ch):
    s = epd_grpc.ControlStub(ch).GetStatus(epd_pb2.GetStatusRequest(protocol_version=1), timeout=5)
    assert s.state == "ready" and s.num_ranks == 2, s


d = epdtest.Daemon(num_ranks=2, extra=["[daemon]", "max_message_bytes = 65536"])
failures = []
try:
    ch = grpc.insecure_channel("unix:" + d.sock)
    grpc.channel_ready_future(ch).result(timeout=10)
    methods = [(f"/epd.v1.Control/{m}", m, m in STREAMING) for m in CONTROL]
    methods += [("/grpc.health.v1.Health/Check", "HealthCheck", False),
                ("/grpc.health.v1.Health/Watch", "HealthWatch", True)]
    n = 0
    for path, name, streaming in methods:
        for what, payload in MALFORMED.items():
            code, details = call(ch, path, payload, streaming)
            n += 1
            if code != grpc.StatusCode.INVALID_ARGUMENT or f"malformed {name}Request" not in details:
                failures.append(f"{name} with {what}: {code} {details!r}")
        if name.startswith("Health"):
            continue
        for v in (2, 1000):
            payload = epd_pb2.GetStatusRequest(protocol_version=v).SerializeToString()  # field 1 in every request
            code, details = call(ch, path, payload, streaming)
            n += 1
            if code != grpc.StatusCode.FAILED_PRECONDITION or f"client speaks {v}, daemon speaks 1" not in details:
                failures.append(f"{name} with protocol_version {v}: {code} {details!r}")
        alive(ch)

    # protocol_version left out (proto3's 0, what grpcurl and generic clients send) means the current one.
    st = epd_grpc.ControlStub(ch).GetStatus(epd_pb2.GetStatusRequest(), timeout=5)
    if st.state != "ready" or st.protocol_version != 1:
        failures.append(f"GetStatus without protocol_version: {st}")
    for name, payload in (("GetMetrics", epd_pb2.GetMetricsRequest()), ("GetExpertMap", epd_pb2.GetExpertMapRequest())):
        code, details = call(ch, f"/epd.v1.Control/{name}", payload.SerializeToString(), False)
        n += 1
        if code == grpc.StatusCode.FAILED_PRECONDITION and "client speaks" in details:
            failures.append(f"{name} without protocol_version: {code} {details!r}")

    # A request over max_message_bytes is refused by the transport, not parsed.
    big = epd_pb2.AttachRequest(protocol_version=1, client_name="x" * 100000).SerializeToString()
    code, details = call(ch, "/epd.v1.Control/Attach", big, False)
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        failures.append(f"oversized Attach: {code} {details!r}")
    # Too-long names are rejected by field.
    code, details = call(ch, "/epd.v1.Control/Attach",
                         epd_pb2.AttachRequest(protocol_version=1, group="g" * 200).SerializeToString(), False)
    if code != grpc.StatusCode.INVALID_ARGUMENT or "group" not in details:
        failures.append(f"long group: {code} {details!r}")
    # Unknown methods and services.
    for path in ("/epd.v1.Control/Nope", "/no.such.Service/Call"):
        code, details = call(ch, path, b"", False)
        if code != grpc.StatusCode.UNIMPLEMENTED:
            failures.append(f"{path}: {code} {details!r}")
    # A client that hangs up mid-stream leaves nothing behind.
    for _ in range(20):
        it = ch.unary_stream("/epd.v1.Control/Watch")(epd_pb2.WatchRequest(protocol_version=1).SerializeToString(),
                                                      timeout=5)
        it.cancel()
    alive(ch)
    ch.close()
    # A fresh connection still works too.
    with grpc.insecure_channel("unix:" + d.sock) as ch2:
        alive(ch2)
    assert d.proc.poll() is None, "epd died"
    rc = d.stop()
    assert rc == 0, f"epd exited {rc}"
    if failures:
        raise AssertionError("\n".join(failures))
    print(f"ok: {n} bad requests answered with clear errors; the daemon still serves")
except BaseException:
    print(d.logtext()[-4000:], file=sys.stderr)
    raise
finally:
    d.cleanup()

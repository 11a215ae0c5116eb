"""The control RPC (gRPC service epd.v1.Control) from Python: status, metrics, expert map, drain.

libepd exposes no C calls for these, so this module talks gRPC directly with grpcio (an optional
dependency: pip install 'epd[control]'). The message classes are generated once from epd.proto with
grpc_tools.protoc (or the protoc binary) into a cache directory ($EPD_PROTO_CACHE, else
~/.cache/epd-python/<hash of the proto>, else a temp dir); no generated file is checked in.
"""

import collections
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from . import errors

PROTOCOL_VERSION = 1

_pb2 = None
_pb2_lock = threading.Lock()


def proto_path():
    """The epd.proto this package uses: $EPD_PROTO, else the copy inside the package."""
    env = os.environ.get("EPD_PROTO")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "epd.proto")


def _cache_dir(digest):
    base = os.environ.get("EPD_PROTO_CACHE")
    if not base:
        base = os.path.join(os.path.expanduser("~"), ".cache", "epd-python")
    d = os.path.join(base, digest[:16])
    try:
        os.makedirs(d, exist_ok=True)
        probe = os.path.join(d, ".w")
        with open(probe, "w"):
            pass
        os.unlink(probe)
        return d
    except OSError:
        return tempfile.mkdtemp(prefix="epd-proto-")


def _generate(src, out):
    """Generate epd_pb2.py from src into out, with grpc_tools if present, else protoc."""
    inc = os.path.dirname(src)
    args = ["-I" + inc, "--python_out=" + out, os.path.basename(src)]
    try:
        from grpc_tools import protoc
        rc = protoc.main(["grpc_tools.protoc"] + args)
        if rc == 0:
            return
        err = "grpc_tools.protoc exited %d" % rc
    except ImportError:
        err = "grpc_tools is not installed"
    exe = shutil.which("protoc")
    if exe is None:
        raise ImportError("cannot generate the epd.proto Python classes: %s and no protoc binary "
                          "(pip install grpcio-tools)" % err)
    subprocess.run([exe] + args, check=True, cwd=inc)


def pb2():
    """The generated epd_pb2 module (generated on first use)."""
    global _pb2
    with _pb2_lock:
        if _pb2 is not None:
            return _pb2
        src = proto_path()
        with open(src, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        out = _cache_dir(digest)
        if not os.path.exists(os.path.join(out, "epd_pb2.py")):
            tmp = tempfile.mkdtemp(prefix=".gen-", dir=out)
            _generate(src, tmp)
            os.replace(os.path.join(tmp, "epd_pb2.py"), os.path.join(out, "epd_pb2.py"))
            shutil.rmtree(tmp, ignore_errors=True)
        # Load under a private name so that another "epd_pb2" on sys.path cannot shadow it.
        spec = importlib.util.spec_from_file_location("_epd_v1_pb2", os.path.join(out, "epd_pb2.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["_epd_v1_pb2"] = mod
        spec.loader.exec_module(mod)
        _pb2 = mod
        return _pb2


def message_to_dict(msg):
    """A protobuf message as plain Python values (every field, defaults included; ints stay ints)."""
    out = {}
    for fd in msg.DESCRIPTOR.fields:
        v = getattr(msg, fd.name)
        if fd.message_type is not None:
            if fd.label == fd.LABEL_REPEATED:
                out[fd.name] = [message_to_dict(m) for m in v]
            else:
                out[fd.name] = message_to_dict(v)
        elif fd.label == fd.LABEL_REPEATED:
            out[fd.name] = list(v)
        else:
            out[fd.name] = v
    return out


class ExpertMap(collections.namedtuple("ExpertMap", "group version num_ranks slots_per_rank placement")):
    """An expert map: placement[e] is the list of (rank, slot) replicas of logical expert e."""

    __slots__ = ()

    def slot_table(self):
        """{(rank, slot): expert} of every used physical slot."""
        return {tuple(r): e for e, reps in enumerate(self.placement) for r in reps}

    def experts_of_rank(self, rank):
        """[expert or -1 for each slot of `rank`] (slots_per_rank entries)."""
        row = [-1] * self.slots_per_rank
        for (r, s), e in self.slot_table().items():
            if r == rank:
                row[s] = e
        return row


_GRPC_TO_EPD = {
    "INVALID_ARGUMENT": -1, "RESOURCE_EXHAUSTED": -7, "NOT_FOUND": -6, "ALREADY_EXISTS": -7,
    "PERMISSION_DENIED": -16, "UNAUTHENTICATED": -16, "DEADLINE_EXCEEDED": -8, "UNIMPLEMENTED": -13,
    "FAILED_PRECONDITION": -20, "UNAVAILABLE": -4, "INTERNAL": -21, "OUT_OF_RANGE": -1,
}


class Control:
    """A gRPC client of epd.v1.Control on a Unix socket path."""

    def __init__(self, socket_path, timeout_s=10.0):
        try:
            import grpc
        except ImportError:
            raise ImportError("epd control calls need grpcio (pip install 'epd[control]')") from None
        self._grpc = grpc
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._pb = pb2()
        self._channel = grpc.insecure_channel("unix:" + os.path.abspath(socket_path))
        self._calls = {}

    def close(self):
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, reply_cls, stream=False):
        if self._channel is None:
            raise errors.Closed(-19, "the control channel is closed", call=method)
        key = (method, stream)
        fn = self._calls.get(key)
        if fn is None:
            mk = self._channel.unary_stream if stream else self._channel.unary_unary
            fn = mk("/epd.v1.Control/" + method, request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=reply_cls.FromString)
            self._calls[key] = fn
        try:
            if stream:
                return fn(request)
            return fn(request, timeout=self.timeout_s)
        except self._grpc.RpcError as e:
            code = e.code().name if hasattr(e, "code") and e.code() is not None else "UNKNOWN"
            details = e.details() if hasattr(e, "details") else str(e)
            raise errors.make_error(_GRPC_TO_EPD.get(code, -4), "%s: %s" % (code, details),
                                    call=method) from None

    def status(self):
        """GetStatus as a dict (version, backend, engine_mode, groups, clients, ranks, config, ...)."""
        pb = self._pb
        return message_to_dict(self._call("GetStatus", pb.GetStatusRequest(protocol_version=PROTOCOL_VERSION),
                                          pb.StatusReply))

    def metrics(self):
        """GetMetrics: the Prometheus text."""
        pb = self._pb
        return self._call("GetMetrics", pb.GetMetricsRequest(protocol_version=PROTOCOL_VERSION),
                          pb.MetricsReply).text

    def expert_map(self, group="default"):
        """GetExpertMap of a group as an ExpertMap."""
        pb = self._pb
        m = self._call("GetExpertMap", pb.GetExpertMapRequest(protocol_version=PROTOCOL_VERSION,
                                                               group=group), pb.ExpertMap)
        n = max([p.expert for p in m.experts] + [-1]) + 1
        placement = [[] for _ in range(n)]
        for p in m.experts:
            placement[p.expert] = [(r.rank, r.slot) for r in p.replicas]
        return ExpertMap(m.group or group, m.version, m.num_ranks, m.slots_per_rank, placement)

    def set_expert_map(self, placement, group="default"):
        """Stage a map (placement[e] = [(rank, slot), ...] or {e: [...]}); returns the staged version.
        It takes effect on every rank at the next step boundary."""
        pb = self._pb
        if isinstance(placement, ExpertMap):
            placement = placement.placement
        items = placement.items() if isinstance(placement, dict) else enumerate(placement)
        msg = pb.ExpertMap(group=group)
        for e, reps in items:
            if isinstance(reps, tuple) and len(reps) == 2 and all(isinstance(v, int) for v in reps):
                reps = [reps]
            p = msg.experts.add(expert=int(e))
            for rank, slot in reps:
                p.replicas.add(rank=int(rank), slot=int(slot))
        reply = self._call("SetExpertMap", pb.SetExpertMapRequest(protocol_version=PROTOCOL_VERSION, map=msg),
                           pb.SetExpertMapReply)
        return reply.version

    def drain(self, exit=False):
        """Drain: no new attach or dispatch (combines still run); exit once idle if exit. Returns clients still attached."""
        pb = self._pb
        return self._call("Drain", pb.DrainRequest(protocol_version=PROTOCOL_VERSION, exit=exit),
                          pb.DrainReply).clients

    def watch(self):
        """Server-streamed events (an iterator of dicts; cancel() the iterator to stop)."""
        pb = self._pb
        it = self._call("Watch", pb.WatchRequest(protocol_version=PROTOCOL_VERSION), pb.Event, stream=True)
        return _EventIter(it)


class _EventIter:
    def __init__(self, it):
        self._it = it

    def __iter__(self):
        return self

    def __next__(self):
        return message_to_dict(next(self._it))

    def cancel(self):
        self._it.cancel()

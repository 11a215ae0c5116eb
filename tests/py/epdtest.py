"""Helpers for the epd system tests: build paths, Python gRPC stubs generated from the protos at test
time (under the build directory, never committed), and a daemon started on a private temp socket."""
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_b = Path(os.environ.get("EPD_BUILD") or "build")
BUILD = _b if _b.is_absolute() else (Path.cwd() / _b if (Path.cwd() / _b).exists() else ROOT / _b)
EPD = BUILD / "bin" / "epd"
EPDCTL = BUILD / "bin" / "epdctl"
HEALTH_PROTO = Path("/usr/share/grpc-proto/grpc/health/v1/health.proto")
PROTOCOL_VERSION = 1


def skip(why):
    print("skip:", why)
    sys.exit(77)


def need_daemon():
    if not EPD.exists():
        skip(f"{EPD} not built")


def stubs():
    """Generate epd_pb2/epd_pb2_grpc and health_pb2/health_pb2_grpc with grpc_tools.protoc into
    $BUILD/py-gen and import them. Returns (epd_pb2, epd_pb2_grpc, health_pb2, health_pb2_grpc)."""
    try:
        import grpc  # noqa: F401
        from grpc_tools import protoc
    except ImportError as e:
        skip(f"python grpc tools missing: {e}")
    out = BUILD / "py-gen"
    src = [ROOT / "proto" / "epd.proto", HEALTH_PROTO]
    stamp = out / ".stamp"
    fresh = stamp.exists() and all(stamp.stat().st_mtime >= p.stat().st_mtime for p in src)
    if not fresh:
        tmp = Path(tempfile.mkdtemp(prefix="py-gen.", dir=BUILD))
        shutil.copy(HEALTH_PROTO, tmp / "health.proto")
        for proto, inc in ((ROOT / "proto" / "epd.proto", ROOT / "proto"), (tmp / "health.proto", tmp)):
            rc = protoc.main(["grpc_tools.protoc", f"-I{inc}", f"--python_out={tmp}",
                              f"--grpc_python_out={tmp}", str(proto)])
            if rc != 0:
                raise RuntimeError(f"grpc_tools.protoc failed on {proto}: {rc}")
        (tmp / ".stamp").touch()
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    sys.path.insert(0, str(out))
    return tuple(importlib.import_module(m) for m in ("epd_pb2", "epd_pb2_grpc", "health_pb2", "health_pb2_grpc"))


class Daemon:
    """The real epd binary on a temp socket, host backend, in the foreground."""

    def __init__(self, num_ranks=2, extra=None):
        need_daemon()
        self.dir = tempfile.mkdtemp(prefix="epd-sys-")
        self.sock = os.path.join(self.dir, "control.sock")
        self.conf = os.path.join(self.dir, "epd.conf")
        with open(self.conf, "w") as f:
            f.write("[daemon]\ntoken_ttl_ms = 60000\ndrain_timeout_ms = 3000\n"
                    f"[engine]\nbackend = host\nnum_ranks = {num_ranks}\nmax_tokens = 64\n"
                    "max_experts = 64\nmax_hidden = 1024\n")
            for line in extra or []:
                f.write(line + "\n")
        self.log = open(os.path.join(self.dir, "epd.log"), "w+")
        self.proc = subprocess.Popen([str(EPD), "-f", "-c", self.conf, "-s", self.sock],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 15
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None:
                raise RuntimeError(f"epd exited with {self.proc.returncode}:\n{self.logtext()}")
            if time.time() > deadline:
                raise RuntimeError(f"epd did not create {self.sock} in 15 s:\n{self.logtext()}")
            time.sleep(0.05)

    def logtext(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def ctl(self, *args, check=True, timeout=20):
        r = subprocess.run([str(EPDCTL), "-s", self.sock, *args], capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"epdctl {' '.join(args)} exited {r.returncode}: {r.stderr}")
        return r

    def stop(self, timeout=15):
        """SIGTERM, wait; returns the exit code (SIGKILL and an error after timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError(f"epd did not exit {timeout} s after SIGTERM:\n{self.logtext()}")
        return self.proc.returncode

    def cleanup(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

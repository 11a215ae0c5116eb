"""Fixtures: a real epd daemon (host backend) in a temp dir, and helpers to drive several ranks.

The build directory is $EPD_BUILD (default: <repo>/build); libepd is $EPD_LIBRARY (default:
$EPD_BUILD/lib/libepd.so). Tests that need the daemon or libepd skip with the reason when they are not
built.
"""

import os
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYDIR)
sys.path.insert(0, PYDIR)  # the package from the source tree unless an installed one is wanted

BUILD = os.path.abspath(os.environ.get("EPD_BUILD") or os.path.join(REPO, "build"))
EPD_BIN = os.path.join(BUILD, "bin", "epd")
LIBEPD = os.environ.get("EPD_LIBRARY") or os.path.join(BUILD, "lib", "libepd.so")
os.environ.setdefault("EPD_LIBRARY", LIBEPD)
os.environ.setdefault("EPD_PROTO_CACHE", os.path.join(BUILD, "python-proto-cache"))


def need_lib():
    if not os.path.exists(LIBEPD):
        pytest.skip("libepd is not built (%s missing: run `make`, or set EPD_LIBRARY)" % LIBEPD)


def need_daemon():
    need_lib()
    if not os.access(EPD_BIN, os.X_OK):
        pytest.skip("the epd daemon is not built (%s missing: run `make`, or set EPD_BUILD)" % EPD_BIN)


class Daemon:
    """An epd daemon process on the host backend with its own control socket."""

    def __init__(self, tmpdir, num_ranks=2, extra=()):
        self.dir = str(tmpdir)
        self.socket = os.path.join(self.dir, "control.sock")
        self.log_path = os.path.join(self.dir, "epd.log")
        conf = os.path.join(self.dir, "epd.conf")
        open(conf, "w").close()  # never read a system-wide /etc/epd/epd.conf
        args = [EPD_BIN, "-f", "-c", conf, "-s", self.socket, "-o", "engine.backend=host",
                "-o", "engine.num_ranks=%d" % num_ranks, "-o", "engine.step_timeout_ms=3000"]
        for kv in extra:
            args += ["-o", kv]
        self.args = args
        self.log = open(self.log_path, "w")
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready()

    def _wait_ready(self, timeout=15.0):
        import epd
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("epd exited with %d at start:\n%s" % (self.proc.returncode, self.log_text()))
            if os.path.exists(self.socket):
                try:
                    epd.connect(self.socket).close()
                    return
                except epd.EpdError as e:
                    last = e
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("epd not ready after %.0fs (%s):\n%s" % (timeout, last, self.log_text()))

    def log_text(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def daemon(tmp_path):
    need_daemon()
    d = Daemon(tmp_path)
    yield d
    d.stop()


@pytest.fixture
def conn(daemon):
    import epd
    c = epd.connect(daemon.socket)
    yield c
    c.close()


def run_ranks(fns, timeout=30.0):
    """Run fns[r]() on one thread per rank (collective calls block until every rank submits); return
    their results, or raise the first exception (in rank order)."""
    results = [None] * len(fns)
    excs = [None] * len(fns)

    def body(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: B902 - reported below
            excs[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("a rank did not finish within %.0fs" % timeout)
    for e in excs:
        if e is not None:
            raise e
    return results


def run_ranks_all(fns, timeout=30.0):
    """Like run_ranks but return (results, exceptions) without raising."""
    results = [None] * len(fns)
    excs = [None] * len(fns)

    def body(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: B902
            excs[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("a rank did not finish within %.0fs" % timeout)
    return results, excs

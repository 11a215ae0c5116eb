"""Packaging: import without torch, the proto copy, pip install, the DLPack layout, the example."""

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

import epd
from conftest import PYDIR, REPO, need_daemon


def test_import_without_torch_and_api():
    code = ("import sys; sys.modules['torch'] = None; import epd, epd.vllm, epd.reference; "
            "print(epd.__version__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=PYDIR, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == epd.__version__
    for name in ("connect", "Connection", "Endpoint", "EpdError", "BadExpert", "f32_to_bf16"):
        assert hasattr(epd, name)


def test_error_classes_carry_code_and_text():
    e = epd.errors.make_error(-14, "rank 1 token 2 k 0: expert 8 not in [-1, 8)", call="dispatch", peer=1)
    assert isinstance(e, epd.BadExpert) and isinstance(e, epd.EpdError) and isinstance(e, ValueError)
    assert e.code == -14 and e.name == "EPD_ERR_BAD_EXPERT" and e.peer == 1
    assert "dispatch: EPD_ERR_BAD_EXPERT (-14): rank 1 token 2" in str(e) and "peer rank 1" in str(e)
    assert isinstance(epd.errors.make_error(-8), TimeoutError)
    assert type(epd.errors.make_error(-99)) is epd.EpdError
    assert epd.errors.code_name(0) == "EPD_OK"


def test_missing_library_message(monkeypatch, tmp_path):
    r = subprocess.run([sys.executable, "-c", "import epd; epd.connect('/nonexistent')"], cwd=PYDIR,
                       capture_output=True, text=True,
                       env=dict(os.environ, EPD_LIBRARY=str(tmp_path / "libepd.so")))
    assert r.returncode != 0 and "EPD_LIBRARY" in r.stderr


def test_proto_copy_in_sync():
    with open(os.path.join(REPO, "proto", "epd.proto")) as a, \
            open(os.path.join(PYDIR, "epd", "epd.proto")) as b:
        assert a.read() == b.read(), "python/epd/epd.proto differs from proto/epd.proto: copy it again"


def test_control_messages_generate():
    pytest.importorskip("grpc")
    from epd import control
    pb = control.pb2()
    m = pb.ExpertMap(group="g", version=3)
    m.experts.add(expert=0).replicas.add(rank=1, slot=2)
    d = control.message_to_dict(m)
    assert d["version"] == 3 and d["experts"][0]["replicas"] == [{"rank": 1, "slot": 2}]


def test_dlpack_capsule_layout_with_numpy():
    """The DLManagedTensor built for torch, consumed here by NumPy (CPU), shares the memory."""
    from epd import _dlpack
    buf = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    addr = buf.__array_interface__["data"][0]

    class Exporter:
        def __dlpack__(self, stream=None, **kw):
            return _dlpack.capsule(addr, (2, 3, 4), "float32", _dlpack.kDLCPU, 0, buf)

        def __dlpack_device__(self):
            return (_dlpack.kDLCPU, 0)

    n0 = _dlpack.live_count()
    view = np.from_dlpack(Exporter())
    assert view.shape == (2, 3, 4) and view.dtype == np.float32
    assert view.__array_interface__["data"][0] == addr
    buf[1, 2, 3] = -7
    assert view[1, 2, 3] == -7
    del view
    import gc
    gc.collect()
    assert _dlpack.live_count() == n0  # the deleter ran


def test_torch_cpu_views_if_torch_present(conn):
    torch = pytest.importorskip("torch")
    with conn.attach("torchcpu", rank=0, num_experts=8, hidden=128, topk=2, max_tokens=8) as ep:
        t = ep.tensor("x", 0)
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == (8, 128)
        t[0, 0] = 1.0
        assert ep.array("x", 0)[0, 0] == 0x3F80
        assert ep.tensor("ll_recv_x", 0, fp8=True).dtype == torch.float8_e4m3fn


@pytest.mark.skipif(os.environ.get("EPD_SKIP_PIP") == "1", reason="EPD_SKIP_PIP=1")
def test_pip_install(tmp_path):
    import shutil
    target = tmp_path / "site"
    src = tmp_path / "src"  # build from a copy: setuptools writes build/ and *.egg-info beside the sources
    shutil.copytree(PYDIR, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                        "--no-index", "--quiet", "--target", str(target), str(src)],
                       capture_output=True, text=True, timeout=240)
    if r.returncode != 0 and "No module named" in r.stderr and "setuptools" in r.stderr:
        pytest.skip("setuptools is not installed")
    assert r.returncode == 0, r.stdout + r.stderr
    code = "import epd, epd.vllm, epd.control; print(epd.__file__); print(epd.control.proto_path())"
    r = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(target)))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines[0].startswith(str(target)) and os.path.exists(lines[1])


@pytest.mark.parametrize("args", [["--steps", "8"], ["--steps", "6", "--fp8"], ["--steps", "6", "--mode", "ht"]])
def test_example_moe_layer_host(daemon, args):
    ex = os.path.join(PYDIR, "examples", "moe_layer.py")
    r = subprocess.run([sys.executable, ex, "--host", "--socket", daemon.socket, "--hidden", "128",
                        "--inter", "256", "--max-tokens", "16"] + args,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr + daemon.log_text()
    assert "0 mismatches" in r.stdout

"""The capture child: starts the CUPTI session, runs the work, writes what it recorded.

Two ways in, both driven by a spec JSON that the parent wrote (:func:`capture.run_capture`):

- ``python -m decodescope.tracer.child SPEC``: runs a registered workload
  (``{"workload": NAME, "opts": {...}, "graph": bool, "steps": N, "warmup": N}``) or a fake one
  for tests (``{"fake": "ok" | "crash" | "hang" | "exit" | "cuda_error"}``, no CUDA at all);
- ``bootstrap()``, called from the ``sitecustomize`` the parent puts on ``PYTHONPATH``: starts the
  session before any program runs (``decodescope capture -- python prog.py``) and stops it at exit.

Files in the spec's ``out`` folder: chunk-*.arrow (raw rows), env.json (GPU, versions, workload
meta), status.json (written on a clean end), error.json (one line on failure).

Session keys of the spec (all optional): ``launch_records`` (callback | activity | none),
``flush_period_ms``, ``buffer_bytes`` (64 MB), ``kinds`` (activity kind names), ``graph_nodes``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from decodescope.tracer import capture as cap
from decodescope.tracer.ranges import range as trange

_session: cap.Session | None = None
_out: Path | None = None


def _write_json(name: str, data: dict[str, Any]) -> None:
    if _out is None:
        return
    p = _out / name
    tmp = p.with_name("." + name + ".tmp")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, p)


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {msg}"[:500]


def env_info(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """GPU and software versions, from whatever is already imported (never imports torch)."""
    info: dict[str, Any] = {"python": sys.version.split()[0], "pid": os.getpid()}
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            info["torch"] = torch.__version__
            info["cuda"] = torch.version.cuda
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                info["gpu"] = torch.cuda.get_device_name()
    with contextlib.suppress(Exception):
        import ctypes

        v = ctypes.c_int(0)
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
        info["driver"] = f"{v.value // 1000}.{(v.value % 1000) // 10}"
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["cutlass_dsl"] = version("nvidia-cutlass-dsl")
    if extra:
        info.update(extra)
    return info


def _start(spec: dict[str, Any]) -> cap.Session:
    global _session, _out
    _out = Path(spec["out"])
    extra: dict[str, Any] = {}
    if spec.get("buffer_bytes"):
        extra["buffer_bytes"] = int(spec["buffer_bytes"])
    if spec.get("kinds"):
        extra["kinds"] = tuple(spec["kinds"])
    if "graph_nodes" in spec:
        extra["graph_nodes"] = bool(spec["graph_nodes"])
    if spec.get("hw_trace"):
        extra["hw_trace"] = True
    _session = cap.Session(
        _out,
        flush_period_ms=int(spec.get("flush_period_ms", 0) or 0),
        launch_records=spec.get("launch_records", "activity"),
        **extra,
    )
    if spec.get("fake"):
        return _session  # CPU tests: no CUPTI
    _session.start()
    return _session


def _finish(status: dict[str, Any] | None = None, info: dict[str, Any] | None = None) -> None:
    """Stop the session and write what it holds; never raises."""
    with contextlib.suppress(Exception):
        _write_json("env.json", env_info(info))
    if _session is not None:
        try:
            _sync_cuda()
            _session.stop() if _session.running else _session.write_chunk()
        except Exception as e:
            print(f"decodescope: stopping the capture failed: {_one_line(e)}", file=sys.stderr)
    if status is not None:
        with contextlib.suppress(Exception):
            _write_json("status.json", status)


def _sync_cuda() -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()


def _on_term(signum: int, frame: Any) -> None:
    _write_json(
        "error.json", {"message": f"stopped by signal {signum} (timeout)", "kind": "timeout"}
    )
    _finish()
    os._exit(124)


# ---------------------------------------------------------------------------------------------
# workloads


def _find_workload(name: str):
    import importlib
    import pkgutil

    from decodescope.kernels import workloads as reg

    if name in reg.WORKLOADS:
        return reg.WORKLOADS[name]
    with contextlib.suppress(ImportError):
        importlib.import_module(f"decodescope.kernels.{name}")
    if name in reg.WORKLOADS:
        return reg.WORKLOADS[name]
    import decodescope.kernels as kpkg

    for m in pkgutil.walk_packages(kpkg.__path__, "decodescope.kernels."):
        with contextlib.suppress(Exception):
            importlib.import_module(m.name)
        if name in reg.WORKLOADS:
            return reg.WORKLOADS[name]
    known = ", ".join(sorted(reg.WORKLOADS)) or "none"
    raise LookupError(f"no workload named {name!r} (registered: {known})")


def run_workload(spec: dict[str, Any], session: cap.Session) -> dict[str, Any]:
    """Warm up, then run ``steps`` eager steps or capture once and replay ``steps`` times."""
    import torch

    factory = _find_workload(spec["workload"])
    opts = dict(spec.get("opts") or {})
    wl = factory(**opts)
    steps, warmup, graph = (
        int(spec.get("steps", 20)),
        int(spec.get("warmup", 3)),
        bool(spec.get("graph")),
    )
    if wl.refresh is not None:
        wl.refresh()
    meta_extra: dict[str, Any] = {}
    if spec.get("copy_bw"):  # the bytes floor's bandwidth, measured in this process
        from decodescope.kernels.bandwidth import copy_bandwidth_tbs

        meta_extra["copy_bw_tbs"] = copy_bandwidth_tbs()
        from decodescope.kernels.bandwidth import gemm_tflops

        meta_extra["gemm_tflops"] = gemm_tflops()  # the compute floors' rate
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1 if graph else 0)):
            with trange("warmup"):
                wl.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    times: list[float] = []
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), trange("step"):
            wl.step()
        torch.cuda.synchronize()
        session.discard()
        for _ in range(steps):
            t = time.perf_counter()
            g.replay()
            times.append(time.perf_counter() - t)
    else:
        session.discard()
        for _ in range(steps):
            t = time.perf_counter()
            with trange("step"):
                wl.step()
            times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return {"meta": {**dict(wl.meta), **meta_extra}, "host_step_s": times}


def _fake(kind: str) -> None:
    """CPU-only stand-ins for failure tests."""
    if kind in ("ok", "crash_at_exit"):
        return
    if kind == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind == "hang":
        while True:
            time.sleep(0.2)
    if kind == "exit":
        sys.stderr.write("fake workload: giving up\n")
        sys.exit(7)
    if kind == "cuda_error":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    raise ValueError(f"unknown fake workload {kind!r}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    os.environ[cap.OWNER_ENV] = str(os.getpid())
    signal.signal(signal.SIGTERM, _on_term)
    try:
        session = _start(spec)
        if spec.get("fake"):
            rows = spec.get("fake_rows") or {}
            for kind, lst in rows.items():
                session._rows[kind].extend(lst)  # what a real session would have converted
            session.write_chunk()
            _fake(spec["fake"])
            result: dict[str, Any] = {"meta": {"workload": "fake"}}
        else:
            result = run_workload(spec, session)
    except Exception as e:
        traceback.print_exc()
        _write_json("error.json", {"message": _one_line(e), "kind": "exception"})
        _finish(info={})
        return 3
    _finish(
        status={"completed": True, "host_step_s": result.get("host_step_s")},
        info={"workload_meta": result.get("meta")},
    )
    if spec.get("fake") == "crash_at_exit":  # tests: a teardown crash after everything is written
        os.kill(os.getpid(), signal.SIGSEGV)
    return 0


# ---------------------------------------------------------------------------------------------
# any program


def bootstrap() -> None:
    """Start the session in this process (called from the capture's ``sitecustomize``)."""
    spec_path = os.environ.get(cap.SPEC_ENV)
    if not spec_path or os.environ.get(cap.OWNER_ENV):
        return
    os.environ[cap.OWNER_ENV] = str(os.getpid())  # children of the program do not capture
    spec = json.loads(Path(spec_path).read_text())
    spec.setdefault("flush_period_ms", 2000)
    try:
        _start(spec)
    except Exception as e:  # the program still runs; the parent reports why nothing was captured
        _write_json(
            "error.json",
            {"message": f"the CUPTI session could not start: {_one_line(e)}", "kind": "session"},
        )
        print(f"decodescope: capture disabled: {_one_line(e)}", file=sys.stderr)
        return
    if spec.get("modules"):
        from decodescope.tracer.modules import instrument

        instrument()
    prev_hook = sys.excepthook

    def hook(t, e, tb):  # a program that dies of an exception: say so in one line
        with contextlib.suppress(Exception):
            _write_json("error.json", {"message": _one_line(e), "kind": "exception"})
        prev_hook(t, e, tb)

    sys.excepthook = hook
    signal.signal(signal.SIGTERM, _on_term)

    def at_exit() -> None:
        _finish(status={"completed": True})

    atexit.register(at_exit)


if __name__ == "__main__":
    code = main()
    # leave without interpreter teardown: nothing may call back into Python from CUPTI or CUDA
    # while modules are being torn down, and everything is written already
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""Several GPUs: one process per rank, each under its own capture, merged into one run.

::

    decodescope capture --workload standard --tp-world 2 ...   (ui/cmd_capture.py)
      run_distributed_capture(spec, world=2, out=OUT)
        rank 0: capture child (tracer/child.py), env RANK=0 LOCAL_RANK=0 WORLD_SIZE=2 MASTER_*
        rank 1: capture child, env RANK=1 LOCAL_RANK=1 ...     -> OUT.ranks/rank{r} (own runs)
      the workload joins the process group itself (kernels/standard/comm.init_from_env:
      NCCL on GPU LOCAL_RANK, gloo on a CPU); the parent waits on all ranks
      merge_runs(per-rank runs) -> OUT (one run, ``rank`` column = the rank)

- Every process started here gets ``NO_MULTICAST_ENV`` (NCCL_NVLS_ENABLE=0,
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1), always, before torch starts:
  NVLink multicast can take the host's GPUs out of service.
- Failure: when one rank exits non-zero, the others (which would wait in a collective for ever)
  get SIGTERM (they flush and write what they captured), SIGKILL after a grace period. The
  parent never hangs: every rank also has the capture's own timeout. The result says in one
  line which rank failed first and why; the merged run is marked partial.
- :func:`launch` is the same fail-fast process group without capture (GPU scripts, tests).

Clocks: the ranks' kernel timestamps come from CUPTI in separate processes on one host, both on
the host's clock (CUPTI normalises GPU timestamps to it), so the ranks' times are comparable;
their skew (analysis/metrics.rank_skew) is meaningful to about a microsecond, not better.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from decodescope.analysis.schema import Run, RunMeta
from decodescope.tracer.capture import NO_MULTICAST_ENV

__all__ = [
    "NO_MULTICAST_ENV",
    "apply_no_multicast",
    "free_port",
    "rank_env",
    "launch",
    "RankResult",
    "DistributedResult",
    "run_distributed_capture",
    "merge_runs",
]


def apply_no_multicast(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set the no-multicast variables in ``env`` (default: this process's os.environ)."""
    target = os.environ if env is None else env
    target.update(NO_MULTICAST_ENV)
    return target  # type: ignore[return-value]


def free_port() -> int:
    """A TCP port free on this host right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(
    rank: int, world: int, port: int, addr: str = "127.0.0.1", local_rank: int | None = None
) -> dict[str, str]:
    """What a rank's process needs: torch.distributed's env:// variables and no multicast."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        **NO_MULTICAST_ENV,
    }


# ---------------------------------------------------------------------------------------------
# a group of processes that fail together


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: could not be reaped
    stopped: bool  # ended by us because another rank failed or the time ran out
    timed_out: bool
    log: Path | None = None
    tail: list[str] = dataclasses.field(default_factory=list)

    def failure(self) -> str | None:
        """One line on why this rank failed (with its last line of output); None if it exited 0."""
        if self.returncode == 0:
            return None
        why = (
            "stopped (time limit or the other rank failed)"
            if self.stopped
            else f"exit code {self.returncode}"
        )
        last = next((x for x in reversed(self.tail) if x.strip()), "")
        return f"{why}: {last[:300]}"


def collect_rank_rows(
    results: Sequence[RankResult], folder: Path, **row: Any
) -> list[dict[str, Any]]:
    """The rows a GPU script's ranks wrote to ``folder/rank{r}.json`` (JSON lists), then one
    failing row per rank process that did not exit 0 (``row`` + check, ok, error, rank)."""
    rows: list[dict[str, Any]] = []
    for r in results:
        f = Path(folder) / f"rank{r.rank}.json"
        if f.exists():
            rows.extend(json.loads(f.read_text()))
    for r in results:
        err = r.failure()
        if err is not None:
            rows.append(
                {**row, "check": f"rank {r.rank} process", "ok": False, "error": err,
                 "rank": r.rank}
            )  # fmt: skip
    return rows


class _Group:
    """Watches processes; when one fails, stops the rest (SIGTERM, then SIGKILL after grace)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.procs: dict[int, subprocess.Popen] = {}
        self.term_at: dict[int, float] = {}
        self.killed: set[int] = set()
        self.first_failure: int | None = None
        self.lock = threading.Lock()

    def add(self, rank: int, proc: subprocess.Popen) -> None:
        with self.lock:
            self.procs[rank] = proc
            if self.first_failure is not None:  # started after another rank failed
                self._term(rank)

    def _term(self, rank: int) -> None:
        p = self.procs[rank]
        if p.poll() is None and rank not in self.term_at:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
            self.term_at[rank] = time.monotonic()

    def stop_all(self, reason_rank: int | None = None) -> None:
        with self.lock:
            if self.first_failure is None:
                self.first_failure = reason_rank if reason_rank is not None else -1
            for r in list(self.procs):
                self._term(r)

    def poll(self) -> None:
        """One round: notice a failed rank, escalate SIGTERM to SIGKILL after the grace."""
        with self.lock:
            for r, p in self.procs.items():
                rc = p.poll()
                if rc is not None and rc != 0 and self.first_failure is None:
                    self.first_failure = r
                    for o in self.procs:
                        if o != r:
                            self._term(o)
            now = time.monotonic()
            for r, t in self.term_at.items():
                p = self.procs[r]
                if p.poll() is None and now - t > self.grace_s and r not in self.killed:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGKILL)
                    self.killed.add(r)


def _tail(path: Path, n: int = 20) -> list[str]:
    try:
        return path.read_bytes()[-8192:].decode("utf-8", "replace").splitlines()[-n:]
    except OSError:
        return []


def launch(
    argvs: Sequence[Sequence[str]],
    envs: Sequence[dict[str, str]],
    *,
    timeout: float,
    grace_s: float = 10.0,
    logs: Sequence[Path] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> list[RankResult]:
    """Run one process per rank (``argvs[r]`` with ``os.environ + envs[r]`` and no multicast),
    wait for all; a rank that fails stops the others, and ``timeout`` stops everyone. stdout and
    stderr of rank r go to ``logs[r]`` (or are discarded). Never hangs past timeout + 2 grace."""
    group = _Group(grace_s)
    started = time.monotonic()
    files = []
    try:
        for r, (argv, extra) in enumerate(zip(argvs, envs, strict=True)):
            env = {**os.environ, **extra, **NO_MULTICAST_ENV}
            f = open(logs[r], "wb") if logs else subprocess.DEVNULL  # noqa: SIM115
            files.append(f)
            p = subprocess.Popen(
                list(argv), env=env, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                start_new_session=True,
            )  # fmt: skip
            group.add(r, p)
        timed_out = False
        while any(p.poll() is None for p in group.procs.values()):
            group.poll()
            if not timed_out and time.monotonic() - started > timeout:
                timed_out = True
                group.stop_all()
            if time.monotonic() - started > timeout + 3 * grace_s:
                break  # unkillable (D state): give up waiting, report
            time.sleep(0.05)
        group.poll()
    except BaseException:
        group.stop_all()
        for p in group.procs.values():
            with contextlib.suppress(Exception):
                p.wait(timeout=grace_s)
        raise
    finally:
        for f in files:
            if f is not subprocess.DEVNULL:
                f.close()
    out = []
    for r, p in sorted(group.procs.items()):
        log = Path(logs[r]) if logs else None
        out.append(
            RankResult(r, p.poll(), r in group.term_at, timed_out, log, _tail(log) if log else [])
        )
    return out


# ---------------------------------------------------------------------------------------------
# captures


@dataclasses.dataclass
class DistributedResult:
    run: Run  # the merged run (rank column), partial if any rank failed
    out: Path | None
    ok: bool
    message: str | None  # one line: which rank failed first and why
    rank_results: list[Any]  # capture.CaptureResult per rank (None where it raised)
    rank_dirs: list[Path | None]


def run_distributed_capture(
    spec: dict[str, Any],
    world: int,
    *,
    out: str | os.PathLike[str] | None,
    timeout: float | None = 600.0,
    rank_specs: Sequence[dict[str, Any]] | None = None,
    meta: dict[str, Any] | None = None,
    grace_s: float = 10.0,
    echo: bool = True,
    port: int | None = None,
) -> DistributedResult:
    """Capture ``spec`` (a workload spec, see tracer/child.py) on ``world`` ranks at once and
    write the merged run to ``out`` (each rank's own run to ``OUT.ranks/rank{r}``).

    The workload option ``tp_world`` is set to ``world``. ``rank_specs[r]`` updates rank r's
    spec (tests: a failing rank)."""
    from decodescope.tracer import capture
    from decodescope.tracer.store import write_run

    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    port = port or free_port()
    run_id = (meta or {}).get("run_id") or (
        f"{spec.get('workload') or 'capture'}-tp{world}-{time.strftime('%Y%m%dT%H%M%S')}"
        f"-{uuid.uuid4().hex[:6]}"
    )
    out_path = Path(out) if out is not None else None
    rank_root = out_path.with_name(out_path.name + ".ranks") if out_path else None
    group = _Group(grace_s)
    results: list[Any] = [None] * world
    errors: list[str | None] = [None] * world

    def one(r: int) -> None:
        s = json.loads(json.dumps(spec))
        s.setdefault("opts", {})
        if "workload" in s:
            s["opts"]["tp_world"] = world
        if rank_specs is not None:
            s.update(rank_specs[r])
        try:
            results[r] = capture.run_capture(
                s,
                out=(rank_root / f"rank{r}") if rank_root else None,
                timeout=timeout,
                meta={**(meta or {}), "run_id": run_id},
                env=rank_env(r, world, port),
                grace_s=grace_s,
                echo=False,
                on_start=lambda p: group.add(r, p),
            )
        except Exception as e:  # noqa: BLE001  (reported per rank, one line)
            errors[r] = f"{type(e).__name__}: {' '.join(str(e).split())}"
            group.stop_all(r)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            group.poll()
            time.sleep(0.05)
    except KeyboardInterrupt:
        group.stop_all()
        for t in threads:
            t.join(timeout=3 * grace_s)
        raise
    group.poll()

    ranks_ok = [res is not None and res.ok for res in results]
    first = group.first_failure
    if first is None or first < 0:
        bad = [r for r in range(world) if not ranks_ok[r]]
        first = bad[0] if bad else None
    message = None
    if first is not None:
        why = errors[first] or (results[first].message if results[first] else None) or "failed"
        others = [r for r in range(world) if r != first and r in group.term_at]
        message = f"rank {first} of {world} failed: {why}"
        if others:
            message += f"; stopped rank{'s' if len(others) > 1 else ''} " + ", ".join(
                map(str, others)
            )
    runs = [res.run if res is not None else None for res in results]
    if echo and message:
        for r, res in enumerate(results):
            if res is not None and not res.ok:
                for line in res.stderr_tail[-10:]:
                    print(f"  rank {r}| {line}", file=sys.stderr)
    present = [(r, run) for r, run in enumerate(runs) if run is not None]
    if not present:
        merged = Run(
            meta=RunMeta(run_id=run_id, source="cupti", tp_world=world, partial=True,
                         notes=message)
        )  # fmt: skip
    else:
        merged = merge_runs([run for _, run in present], ranks=[r for r, _ in present])
        if message:
            merged = merged.replace(
                meta=merged.meta.replace(
                    partial=True,
                    tp_world=world,
                    notes="; ".join(n for n in (merged.meta.notes, message) if n),
                )
            )
    written = write_run(merged, out_path, overwrite=True) if out_path is not None else None
    return DistributedResult(
        merged,
        written,
        message is None,
        message,
        results,
        [res.out if res is not None else None for res in results],
    )


# ---------------------------------------------------------------------------------------------
# merge


def _with_rank(t: pa.Table, rank: int) -> pa.Table:
    i = t.schema.get_field_index("rank")
    col = pa.array([rank] * t.num_rows, type=t.schema.field("rank").type)
    return t.set_column(i, "rank", col)


def merge_runs(runs: Sequence[Run], ranks: Sequence[int] | None = None) -> Run:
    """One run from per-rank runs of one capture: every table's ``rank`` column set to the
    rank (``ranks[i]``, default i), rows concatenated; the metadata of the lowest rank, with
    ``tp_world`` = its recorded tp_world (else the number of runs), ``partial`` if any was,
    dropped records summed, and per rank (gpu, run_id, partial, notes, copy_bw_tbs,
    gemm_tflops, layer_bytes) in config_json["ranks"]."""
    if not runs:
        raise ValueError("merge_runs: no runs")
    ranks = list(range(len(runs))) if ranks is None else list(ranks)
    if len(set(ranks)) != len(ranks) or len(ranks) != len(runs):
        raise ValueError(f"merge_runs: ranks {ranks} must be distinct, one per run")
    order = sorted(range(len(runs)), key=lambda i: ranks[i])
    runs = [runs[i] for i in order]
    ranks = [ranks[i] for i in order]
    tables = {}
    for name in ("kernels", "ranges", "memops", "overheads"):
        parts = [_with_rank(getattr(run, name), r) for run, r in zip(runs, ranks, strict=True)]
        tables[name] = pa.concat_tables(parts).unify_dictionaries().combine_chunks()
    m0 = runs[0].meta
    config = m0.config
    config["ranks"] = [
        {
            "rank": r,
            "run_id": run.meta.run_id,
            "gpu": run.meta.gpu,
            "host": run.meta.host,
            "partial": run.meta.partial,
            "notes": run.meta.notes,
            "copy_bw_tbs": run.meta.copy_bw_tbs,
            "gemm_tflops": run.meta.gemm_tflops,
            "layer_bytes": run.meta.layer_bytes,
            "dropped_records": run.meta.dropped_records,
        }
        for run, r in zip(runs, ranks, strict=True)
    ]
    drops = [run.meta.dropped_records for run in runs if run.meta.dropped_records is not None]
    notes = []
    for run, r in zip(runs, ranks, strict=True):
        if run.meta.notes and run.meta.notes not in notes:
            notes.append(run.meta.notes if r == ranks[0] else f"rank {r}: {run.meta.notes}")
    meta = m0.replace(
        tp_world=m0.tp_world if (m0.tp_world or 1) > 1 else len(runs),
        partial=any(bool(run.meta.partial) for run in runs) or None,
        dropped_records=sum(drops) if drops else None,
        notes="; ".join(notes) or None,
        config_json=json.dumps(config, default=str),
    )
    if not meta.partial:
        meta = meta.replace(partial=m0.partial)
    return Run(meta=meta, **tables)

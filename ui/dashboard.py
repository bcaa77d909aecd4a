"""The decodescope dashboard: two decode runs side by side (Streamlit + plotly).

Run it through ``decodescope dashboard [RUN_OR_DATASET ...]`` (``ui/cmd_dashboard.py``), which
passes the sources in the environment variable ``DECODESCOPE_DASHBOARD_SOURCES``
(``os.pathsep``-separated); ``streamlit run ui/dashboard.py -- PATH ...`` works too. With no
sources it opens :data:`DEFAULT_DATA`.

This page renders; it computes nothing of its own: runs come from ``decodescope.tracer``, every
figure from ``decodescope.analysis`` (metrics, compare, regress), every chart from
``decodescope.ui.figures``. A source that cannot be read is a message in the page, never a
traceback.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import shutil
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import streamlit as st

from decodescope import tracer
from decodescope.analysis import compare, metrics, regress
from decodescope.analysis import timeline as tl
from decodescope.analysis.dataset import BASELINE_KEYS, same_setup
from decodescope.analysis.schema import Run
from decodescope.tracer import dataset
from decodescope.tracer.errors import TraceError
from decodescope.ui import figures
from decodescope.ui.op_floors import op_floors

# The data a bare `decodescope dashboard` opens: the committed H200 results dataset
# (standard vs specialized, `decodescope bench`), else the two real imported traces bundled
# with the package (an installed copy without the repository's results/).
RESULTS_DATA = Path(__file__).resolve().parent.parent / "results"
BUNDLED_TRACES = Path(__file__).parent / "data" / "default"
DEFAULT_DATA: tuple[Path, ...] = (RESULTS_DATA,) if RESULTS_DATA.is_dir() else (BUNDLED_TRACES,)
SOURCES_ENV = "DECODESCOPE_DASHBOARD_SOURCES"
VIEWS = ("Side by side", "Charts", "Timeline", "Kernels", "History", "Run metadata")
UPLOAD_DIR = Path(tempfile.gettempdir()) / "decodescope-uploads"
UPLOAD_TYPES = ["json", "gz", "sqlite", "zip"]
UPLOADED = "upload: "  # the origin of an uploaded file's entry

META_FIELDS = (
    ("gpu", "GPU"),
    ("driver", "driver"),
    ("cuda", "CUDA"),
    ("torch", "torch"),
    ("cutlass_dsl", "CuTe DSL"),
    ("workload", "workload"),
    ("backend", "backend"),
    ("preset", "preset"),
    ("tp_shape", "tp_shape"),
    ("tp_world", "tp_world"),
    ("batch", "batch"),
    ("tokens_per_seq", "tokens/seq"),
    ("graph_mode", "graph mode"),
    ("dropped_records", "dropped records"),
    ("partial", "partial"),
    ("copy_bw_tbs", "copy bandwidth (TB/s)"),
    ("source", "source"),
    ("source_path", "source path"),
    ("created_at", "created"),
    ("git_commit", "git commit"),
    ("host", "host"),
    ("run_id", "run id"),
    ("notes", "notes"),
)


# ---- sources --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """One loadable run: where it came from (``origin``: the path the user named) and its path."""

    origin: str
    path: str


def requested_sources() -> list[str]:
    """The paths the dashboard was started with (environment, else argv), else DEFAULT_DATA."""
    env = os.environ.get(SOURCES_ENV, "")
    paths = [p for p in env.split(os.pathsep) if p]
    if not paths and sys.argv and Path(sys.argv[0]).name == "dashboard.py":
        paths = [a for a in sys.argv[1:] if not a.startswith("-")]
    return paths or [str(p) for p in DEFAULT_DATA]


def expand(source: str) -> tuple[list[Entry], list[str]]:
    """The runs a source holds: a trace file or run folder is one; a results dataset (Hive
    partitions, ``decodescope.tracer.dataset``) or a folder of run folders is each of them, in
    order of creation. Returns (entries, problems)."""
    p = Path(source)
    try:  # DATASET@RUN_ID: one run of a results dataset, as every command takes it
        ref = tracer.dataset_ref(source)
    except TraceError as e:
        return [], [str(e)]
    if ref is not None:
        return [Entry(source, f"{ref[0]}#{ref[1]}")], []
    if not p.exists():
        return [], [f"{source}: no such file or directory"]
    if p.is_file() or tracer.store.is_run_dir(p):
        return [Entry(source, str(p))], []
    if dataset.is_dataset(p):
        try:
            runs = dataset_runs(str(p), _stamp(str(p)))
        except TraceError as e:
            return [], [str(e)]
        if not runs:
            return [], [f"{source}: empty dataset: it holds no runs"]
        order = sorted(runs, key=lambda r: (str(runs[r].meta.created_at), r))
        return [Entry(source, f"{p}#{rid}") for rid in order], []
    found = sorted(d.parent for d in p.rglob(tracer.store.RUN_FILES["runs"]))
    found = [d for d in found if tracer.store.is_run_dir(d)]
    if not found:
        return [], [not_a_source(p)]
    return [Entry(source, str(d)) for d in found], []


TRACE_SUFFIXES = (".json", ".json.gz", ".sqlite")


def not_a_source(p: Path) -> str:
    """The one line for a folder that holds no run: empty, a results dataset without runs, or
    a folder of something else (traces in it: each is a source of its own, named one by one)."""
    if (p / "runs").is_dir():
        return f"{p}: empty dataset: it holds no runs (no partitions under runs/)"
    try:
        inside = list(p.iterdir())
    except OSError as e:
        return f"{p}: cannot be read ({e.strerror or e})"
    if not inside:
        return f"{p}: empty dataset: the folder is empty (no runs/ partitions, no run folders)"
    traces = [f for f in p.rglob("*") if f.name.endswith(TRACE_SUFFIXES)]
    if traces:
        return (
            f"{p}: not a run folder or results dataset: name its traces one by one (it holds "
            f"{len(traces)} .json / .json.gz / .sqlite file(s))"
        )
    return (
        f"{p}: not a decodescope run folder or results dataset (no runs.parquet, no runs/ "
        "partitions, no run folders in it)"
    )


# a folder's stamp, reused for STAMP_TTL_S: one page run asks for it once per run of a dataset
# (hundreds), and each walk of the folder reads every Parquet file's mtime
STAMP_TTL_S = 2.0
_FOLDER_STAMPS: dict[str, tuple[float, float]] = {}


def _stamp(path: str) -> float:
    """The modification time that keys the caches of ``path`` (a file, a run folder, or a
    dataset run ``DATASET#run_id``: the newest Parquet file of the folder)."""
    p = Path(path.split("#", 1)[0])
    try:
        if p.is_dir():
            now = time.monotonic()
            hit = _FOLDER_STAMPS.get(str(p))
            if hit is not None and now - hit[1] < STAMP_TTL_S:
                return hit[0]
            v = max((f.stat().st_mtime for f in p.rglob("*.parquet")), default=p.stat().st_mtime)
            _FOLDER_STAMPS[str(p)] = (v, now)
            return v
        return p.stat().st_mtime
    except OSError:
        return 0.0


@st.cache_resource(show_spinner=False, max_entries=8)
def dataset_runs(path: str, stamp: float) -> dict[str, Run]:
    """Every run of a results dataset, read once (cached per folder and modification time)."""
    del stamp  # part of the cache key only
    return {r.run_id: r for r in dataset.read_runs(path)}


@st.cache_resource(show_spinner=False, max_entries=64)
def load_run(path: str, stamp: float) -> Run:
    """The run at ``path`` (``DATASET#run_id`` for a run of a results dataset); cached per
    path and modification time."""
    if "#" in path and not Path(path).exists():
        folder, rid = path.split("#", 1)
        return dataset_runs(folder, stamp)[rid]
    return tracer.load(path)


def try_load(entry: Entry) -> tuple[Run | None, str | None]:
    """(run, None) or (None, a one-line message for the page)."""
    where = entry.path
    if entry.origin.startswith(UPLOADED):  # name the file the user uploaded, not our copy
        where = f"{entry.origin.removeprefix(UPLOADED)} (uploaded)"
    try:
        return load_run(entry.path, _stamp(entry.path)), None
    except TraceError as e:
        return None, f"{where}: {e.problem}" if e.path == entry.path else str(e)
    except Exception as e:  # an importer bug must not become a traceback in the page
        return None, f"{where}: could not be read ({type(e).__name__}: {e})"


def save_upload(name: str, data: bytes) -> str:
    """Write an uploaded file under UPLOAD_DIR (keyed by its content); a zip is unpacked and the
    run folder inside it returned. Raises TraceError for a zip without one."""
    digest = hashlib.sha256(data).hexdigest()[:16]
    folder = UPLOAD_DIR / digest
    safe = Path(name).name or "upload"
    if zipfile.is_zipfile(io.BytesIO(data)):
        out = folder / "unzipped"
        if not out.exists():
            UPLOAD_DIR.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=UPLOAD_DIR))
            try:
                with zipfile.ZipFile(io.BytesIO(data)) as z:
                    for member in z.infolist():
                        target = (tmp / member.filename).resolve()
                        if not str(target).startswith(str(tmp.resolve())):
                            raise TraceError(
                                name, f"zip member {member.filename!r} leaves the folder"
                            )
                    z.extractall(tmp)
                folder.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, out)
            except zipfile.BadZipFile as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise TraceError(name, f"not a readable zip file: {e}") from None
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        runs = sorted(d.parent for d in out.rglob(tracer.store.RUN_FILES["runs"]))
        if not runs:
            raise TraceError(name, "zip holds no decodescope run folder (no runs.parquet)")
        return str(runs[0])
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / safe
    if not target.exists():
        tmp = target.with_name(f".{safe}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
    return str(target)


# ---- analysis, cached -------------------------------------------------------------------------


def _rank_filter(kernels: pa.Table, rank: int | None) -> pa.Table:
    if rank is None or kernels.num_rows == 0:
        return kernels
    return kernels.filter(pc.equal(kernels["rank"], rank))


SIDE_TABLES: dict[str, Callable[[pa.Table], pa.Table]] = {
    "kinds": metrics.kind_table,
    "layers": metrics.layer_table,
    "ops": metrics.op_table,
    "kernels": metrics.kernel_table,
    "skew": metrics.skew_table,  # several ranks: the skew between them (all ranks, see below)
    "all_ranks_layers": metrics.layer_table,
}
ALL_RANKS = {"skew", "all_ranks_layers"}  # tables over every rank, whatever the Rank choice
PAIR_TABLES: dict[str, Callable[[pa.Table, pa.Table], pa.Table]] = {
    "kinds": compare.compare_kinds,
    "layers": compare.compare_layers,
    "ops": compare.compare_ops,
    "fused": compare.fused_coverage,
    "one_side": compare.only_one_side,
}


@st.cache_data(show_spinner=False, max_entries=256)
def side_table(name: str, path: str, stamp: float, rank: int | None) -> pa.Table:
    """One per-run table of the analysis (``SIDE_TABLES``) for one run and rank."""
    return SIDE_TABLES[name](
        _rank_filter(load_run(path, stamp).kernels, None if name in ALL_RANKS else rank)
    )


@st.cache_data(show_spinner=False, max_entries=256)
def pair_table(
    name: str, path_a: str, stamp_a: float, path_b: str, stamp_b: float, rank: int | None
) -> pa.Table:
    """One comparison table (``PAIR_TABLES``) of two runs."""
    ka = _rank_filter(load_run(path_a, stamp_a).kernels, rank)
    kb = _rank_filter(load_run(path_b, stamp_b).kernels, rank)
    return PAIR_TABLES[name](ka, kb)


class Tables:
    """The tables of one run or one pair by name, each computed (and cached) when first asked
    for: a tab that is not open costs nothing."""

    def __init__(self, fn: Callable[..., pa.Table], *args: Any) -> None:
        self._fn, self._args = fn, args

    def __getitem__(self, name: str) -> pa.Table:
        return self._fn(name, *self._args)


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


@st.cache_data(show_spinner=False)
def png_export_works() -> bool:
    """Whether kaleido is there and a Chromium it can drive (PNG export); checked without
    starting the browser (that takes seconds), so a PNG is only rendered when asked for."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return False
    return bool(os.environ.get("BROWSER_PATH")) or any(shutil.which(b) for b in BROWSERS)


# ---- page pieces ------------------------------------------------------------------------------


def run_label(run: Run) -> str:
    """``specialized · kimi-k3 · TP8 · batch 1 · NVIDIA H200 [run id]``: the backend, the setup
    that tells runs of one dataset apart (preset, tp_shape, tp_world above 1, batch and tokens per
    sequence), the GPU, the workload where it is not the backend's name, the file of an imported
    trace, then the whole run id (two runs of one day differ after the date)."""
    m = run.meta
    tps = m.tokens_per_seq or 1
    batch = (
        None if m.batch is None else (f"batch {m.batch}x{tps}" if tps > 1 else f"batch {m.batch}")
    )
    bits = [
        m.backend or m.source,
        m.preset,
        f"TP{m.tp_shape}" if m.tp_shape else None,
        f"tp_world {m.tp_world}" if (m.tp_world or 1) > 1 else None,
        batch,
        m.gpu,
        m.workload if m.workload != m.backend else None,
    ]
    name = Path(m.source_path).name if m.source_path else None
    bits.append(name if name and not m.workload else None)
    text = " · ".join(str(b) for b in bits if b)
    return f"{text} [{m.run_id}]"


def path_name(run: Run) -> str:
    """What a side is in a chart's legend: its backend (standard / specialized), else the tool
    that recorded it (kineto, nsys); a workload named at import where the backend is "other"."""
    m = run.meta
    backend = m.backend if m.backend != "other" else None
    return backend or m.workload or m.source or "run"


# what A (standard) and B (specialized) should share; the two backends are different workloads
PAIR_KEYS = ("preset", "batch", "tokens_per_seq", "tp_shape", "tp_world", "gpu")


def default_pair(runs: list[Run]) -> tuple[int, int]:
    """A = a standard run, B = the latest specialized run of the same setup (PAIR_KEYS). Among
    the standard runs that have such a partner, the reference's own figure comes first: batch 1,
    one token per sequence, one GPU, TP8 shapes, then the latest. Without any pair: the latest
    standard run (else the first run) and a specialized run other than it, else the next run,
    else A. Runs come in order of creation; runs captured with kernel knobs (A/B runs of other
    kernels) only where a backend has no run of the defaults."""
    from decodescope.ui.cmd_report import knobs_of

    backends = [r.meta.backend for r in runs]

    def of(backend: str) -> list[int]:
        idx = [i for i, b in enumerate(backends) if b == backend]
        plain = [i for i in idx if not knobs_of(runs[i].meta)]
        return plain or idx

    std = of("standard")
    spec = of("specialized")

    def partners(a: int) -> list[int]:
        setup = {k: getattr(runs[a].meta, k) for k in PAIR_KEYS}
        return [i for i in spec if same_setup(vars_of(runs[i]), setup, PAIR_KEYS)]

    paired = [i for i in std if partners(i)]
    if paired:

        def rank(i: int) -> tuple:
            m = runs[i].meta
            return (
                m.batch != 1, (m.tokens_per_seq or 1) != 1, (m.tp_world or 1) != 1,
                m.tp_shape != 8, -i,
            )  # fmt: skip

        a = min(paired, key=rank)
        return a, partners(a)[-1]
    a = std[-1] if std else 0
    # B: a specialized run other than A (A itself is one where no standard run was loaded),
    # of the defaults first, else with knobs (two specialized runs of a knob A/B)
    for pool in (spec, [i for i, b in enumerate(backends) if b == "specialized"]):
        others = [i for i in pool if i != a]
        if others:
            return a, others[-1]
    return a, next((i for i in range(len(runs)) if i != a), a)


def downloads(name: str, table: pa.Table, key: str) -> None:
    """CSV and Parquet download buttons for a shown table."""
    c1, c2, _ = st.columns([1, 1, 6])
    c1.download_button(
        "CSV",
        data=lambda: figures.table_bytes(table, "csv"),
        file_name=f"{name}.csv",
        mime="text/csv",
        key=f"{key}-csv",
        on_click="ignore",
    )
    c2.download_button(
        "Parquet",
        data=lambda: figures.table_bytes(table, "parquet"),
        file_name=f"{name}.parquet",
        mime="application/octet-stream",
        key=f"{key}-parquet",
        on_click="ignore",
    )


def chart(fig, name: str, key: str) -> None:
    """A plotly chart with HTML and PNG downloads (built when clicked)."""
    st.plotly_chart(fig, key=key, config={"displaylogo": False})
    c1, c2, _ = st.columns([1, 1, 6])
    c1.download_button(
        "HTML",
        data=lambda: figures.to_html(fig),
        file_name=f"{name}.html",
        mime="text/html",
        key=f"{key}-html",
        on_click="ignore",
    )
    png_ok = png_export_works()
    c2.download_button(
        "PNG",
        data=(lambda: figures.to_png(fig)) if png_ok else b"",
        file_name=f"{name}.png",
        mime="image/png",
        key=f"{key}-png",
        on_click="ignore",
        disabled=not png_ok,
        help=None if png_ok else "PNG export needs kaleido with a Chromium; none runs here",
    )


def _show(table: pa.Table, **kwargs: Any) -> None:
    st.dataframe(figures.frame(table), hide_index=True, width="stretch", **kwargs)


_NUM = st.column_config.NumberColumn
_SHORT = {
    "kernels": "kernels",
    "span_us": "span us",
    "busy_us": "busy us",
    "gaps_us": "gaps us",
    "kernel_sum_us": "kernel-sum us",
    "share_us": "share us",
}
_KEYS = ("layer_kind", "rank", "layer", "block", "op", "b_op")


def _compare_view(t: pa.Table) -> dict[str, Any]:
    """Column order and labels for a compare.* table: keys, then per metric A, B, delta, then
    the ratio after span; the rest (steps, per-side kinds) at the end."""
    names = t.column_names
    order = [c for c in _KEYS if c in names]
    cfg: dict[str, Any] = {}
    for m, label in _SHORT.items():
        for c, lab in (
            (f"a_{m}", f"A {label}"),
            (f"b_{m}", f"B {label}"),
            (f"{m}_delta", f"Δ {label}"),
        ):
            if c in names:
                order.append(c)
                cfg[c] = _NUM(lab, format="%.0f" if m == "kernels" else "%.1f")
        if m == "span_us" and "ratio" in names:
            order.append("ratio")
            cfg["ratio"] = _NUM("ratio A/B", format="%.2fx", help="A span / B span: B's speed-up")
    order += [c for c in names if c not in order]
    return {"column_order": order, "column_config": cfg}


def _height(rows: int, cap: int = 60) -> int:
    return 38 + 35 * min(max(rows, 1), cap)


def view_side_by_side(pair: Tables, labels: tuple[str, str], single: bool) -> None:
    kinds = pair["kinds"]
    st.markdown("**Per layer kind** (medians over the layers of each kind)")
    _show(kinds, **_compare_view(kinds))
    downloads("layer_kinds", kinds, "dl-kinds")
    layers = pair["layers"]
    if layers.num_rows == 0:
        st.warning(
            "No kernel of these runs is attributed to a layer: the trace has no layer ranges "
            "that the naming scheme recognises, or no kernel records at all. The kernel table "
            "shows every kernel there is."
        )
        return
    if single:
        st.markdown(f"**Per layer**: {labels[0]}; medians over steps")
    else:
        st.markdown(f"**Per layer**: {labels[0]} vs {labels[1]}, Δ = B - A; medians over steps")
    kind_col = layers["layer_kind"].to_pylist()
    for kind in dict.fromkeys(kind_col):
        sub = layers.filter(pa.array([k == kind for k in kind_col]))
        st.markdown(f"*{kind or '(no kind)'}*: {sub.num_rows} layers")
        _show(sub, height=_height(sub.num_rows), **_compare_view(sub))
    downloads("layers", layers, "dl-layers")
    ops = pair["ops"]
    if ops.num_rows:
        with st.expander("Per op (kernels per layer-step, span and kernel-sum)"):
            _show(ops, height=_height(ops.num_rows), **_compare_view(ops))
            downloads("ops", ops, "dl-ops")
    if not single and pair["fused"].num_rows:
        with st.expander("Fused ops of B and the ops of A they cover"):
            _show(pair["fused"])
            downloads("fused_coverage", pair["fused"], "dl-fused")
    if not single and pair["one_side"].num_rows:
        with st.expander("Kernels that ran on one side only"):
            _show(pair["one_side"])
            downloads("one_side", pair["one_side"], "dl-oneside")


def view_floor(sa: Tables, sb: Tables, run_a: Run, run_b: Run, labels, single: bool) -> None:
    """The bytes floor per layer kind (DESIGN.md section 7), for runs that measured it."""
    parts = []
    sides = [(labels[0], sa, run_a)] + ([] if single else [(labels[1], sb, run_b)])
    for lab, tables, run in sides:
        m = run.meta
        if not (m.layer_bytes and m.copy_bw_tbs):
            continue
        t = metrics.with_floor(tables["kinds"], m.layer_bytes, m.copy_bw_tbs)
        t = t.select(["layer_kind", "kernels", "span_us", "share_us", "bytes", "floor_us",
                      "efficiency", "share_efficiency"])  # fmt: skip
        parts.append(t.add_column(0, "run", pa.array([lab] * t.num_rows, pa.string())))
    if not parts:
        return
    floor = pa.concat_tables(parts)
    st.markdown(
        "**Bytes floor** per layer kind: bytes one layer must move per rank and step / the "
        "copy bandwidth measured in the same process; efficiency = span / floor, and share / "
        "floor for the layer's share of the step (under programmatic dependent launch a "
        "layer's first kernel is resident early, so its span counts part of the previous layer)"
    )
    _show(
        floor,
        column_config={
            "span_us": _NUM("span us", format="%.1f"),
            "floor_us": _NUM("floor us", format="%.1f"),
            "efficiency": _NUM("span / floor", format="%.2fx"),
            "share_us": _NUM("share us", format="%.1f"),
            "share_efficiency": _NUM("share / floor", format="%.2fx"),
            "bytes": _NUM("bytes", format="%d"),
        },
    )
    downloads("bytes_floor", floor, "dl-floor")
    view_op_floors(sa, sb, run_a, run_b, labels, single)


def view_op_floors(sa: Tables, sb: Tables, run_a: Run, run_b: Run, labels, single: bool) -> None:
    """Each op's share beside the floor of its own part of the layer's bytes, for runs of
    decodescope's own workloads (``decodescope report``'s op table:
    :func:`decodescope.ui.op_floors.op_floors`)."""
    parts, notes, rated = [], [], []
    sides = [(labels[0], sa, run_a)] + ([] if single else [(labels[1], sb, run_b)])
    compute = ["flops", "compute_floor_us", "bound"]  # where the run measured its GEMM rate
    for lab, tables, run in sides:
        ops, why = op_floors(run, tables["ops"])
        if why:
            notes.append(f"{lab}: {why}")
        if "op_floor_us" not in ops.column_names:
            continue
        t = ops.select(["layer_kind", "block", "op", "kernels", "share_us", "bytes",
                        "op_floor_us", "share_over_floor_us"])  # fmt: skip
        if "compute_floor_us" in ops.column_names:
            rated.append(f"{lab} {run.meta.gemm_tflops:.0f} TFLOP/s")
            for c in compute:
                t = t.append_column(c, ops[c])
        else:  # the same columns, empty: this run recorded no GEMM rate
            for c, typ in zip(compute, (pa.int64(), pa.float64(), pa.string()), strict=True):
                t = t.append_column(c, pa.nulls(t.num_rows, typ))
        parts.append(t.add_column(0, "run", pa.array([lab] * t.num_rows, pa.string())))
    for n in notes:
        st.caption(n)
    if not parts:
        return
    table = pa.concat_tables(parts)
    if not rated:
        table = table.drop_columns(compute)
    with st.expander("Per op: share against the bytes floor of the op's own part of the layer"):
        st.caption(
            "An op's bytes are its part of the layer's floor (weights, state, cache; the routed "
            "experts the run's routing selected); share - floor above zero is time the bytes do "
            "not explain (latency, hand-offs), below zero an op that streamed before its wait."
            + (" The compute floor is the op's tensor-core FLOPs at the BF16 GEMM rate measured "
               f"beside the run ({', '.join(rated)}); bound: the larger of the two floors."
               if rated else " These runs recorded no GEMM rate: no compute floors.")
        )  # fmt: skip
        _show(
            table,
            column_config={
                "share_us": _NUM("share us", format="%.1f"),
                "bytes": _NUM("bytes", format="%d"),
                "op_floor_us": _NUM("floor us", format="%.1f"),
                "share_over_floor_us": _NUM("share - floor us", format="%+.1f"),
                "flops": _NUM("FLOPs", format="%d"),
                "compute_floor_us": _NUM("compute floor us", format="%.1f"),
            },
        )
        downloads("op_floors", table, "dl-op-floors")


def view_charts(
    sa: Tables, sb: Tables, pair: Tables, labels: tuple[str, str], single: bool
) -> None:
    if sa["layers"].num_rows == 0 and (single or sb["layers"].num_rows == 0):
        st.info(  # nothing per layer or per op to draw: say so rather than draw empty axes
            "No kernel of these runs is attributed to a layer, so there are no per-layer or "
            "per-op charts: the Kernels tab lists every kernel there is, the Timeline tab draws "
            "them over the whole step."
        )
        view_ranks([sa] if single else [sa, sb], labels)
        return
    if not single:
        for label, side in zip(labels, (sa, sb), strict=True):
            if side["layers"].num_rows == 0:  # drawn without it: say so
                st.info(
                    f"{label} has no kernel attributed to a layer: it is left out of the per-layer "
                    "and per-op charts (the Kernels tab lists its kernels)."
                )
    fig = figures.layer_bars(sa["layers"], None if single else sb["layers"], labels)
    chart(fig, "layer_bars", "fig-layers")
    metric = st.radio(
        "Per-op bars show",
        ["share_us", "kernel_sum_us", "kernels", "span_us"],
        format_func=lambda m: figures.METRICS[m],
        horizontal=True,
        key="op-metric",
    )
    fig = figures.op_stack(
        sa["ops"], None if single else sb["ops"], labels, metric=metric, coverage=pair["fused"]
    )
    st.caption(
        "One segment per op, median per layer-step (share: the time the op adds to the step; "
        "a kernel launched early under PDL counts its wait in span and kernel-sum, not in "
        "share); a hatched segment is a fused op of B "
        "(named x+y+z): it takes the colour of its first op, and its hover lists the ops of A "
        "it swallowed."
    )
    chart(fig, "op_stack", "fig-ops")
    view_ranks([sa] if single else [sa, sb], labels)


def view_ranks(sides: list[Tables], labels: tuple[str, str]) -> None:
    """Runs of several ranks (tp_world > 1): each rank's layer spans and the skew between the
    ranks (docs/internal-api.md, "Several GPUs")."""
    for side, label in zip(sides, labels, strict=False):
        layers = side["all_ranks_layers"]
        if layers.num_rows == 0 or len(set(layers["rank"].to_pylist())) < 2:
            continue
        st.caption(
            f"{label}: several ranks. Start/end skew = latest minus earliest rank's layer "
            "start/end in a step (median over steps)."
        )
        fig = figures.rank_spans(layers, side["skew"], label)
        chart(fig, f"rank_spans_{label}", f"fig-ranks-{label}")


def _choices(values: list[Any]) -> list[Any]:
    return sorted({v for v in values if v is not None})


WHOLE_STEP = "(whole step)"
STEP_HELP = "default: the median step, as `decodescope timeline`"


def view_timeline(run_a: Run, run_b: Run, rank: int | None, labels, single: bool) -> None:
    ka = _rank_filter(run_a.kernels, rank)
    kb = _rank_filter(run_b.kernels, rank)
    sides = (ka,) if single else (ka, kb)
    layers = _choices([x for k in sides for x in k["layer"].to_pylist()])
    c1, c2 = st.columns(2)
    layer = c1.selectbox(
        "Layer",
        [*layers, WHOLE_STEP],
        key="tl-layer",
        help="a layer, or every kernel of the step (traces without layer ranges)",
    )
    chosen = None if layer == WHOLE_STEP else layer
    steps_of = []
    for k in sides:
        sel = k if chosen is None else k.filter(pc.equal(k["layer"], chosen))
        steps_of.append(sorted(s for s in set(sel["step"].to_pylist()) if s is not None) or [None])

    # by default the median step, as `decodescope timeline` (a typical replay, not the first;
    # tl.median_step's choice: the lower one of an even count)
    def mid(steps: list) -> int:
        return (len(steps) - 1) // 2

    if len(steps_of) == 1 or steps_of[0] == steps_of[1]:
        step = c2.selectbox(
            "Step", steps_of[0], index=mid(steps_of[0]), key="tl-step", help=STEP_HELP
        )
        step_b = step
    else:  # the runs number their steps differently (imported traces): one step each
        c2a, c2b = c2.columns(2)
        step = c2a.selectbox(
            "Step of A", steps_of[0], index=mid(steps_of[0]), key="tl-step", help=STEP_HELP
        )
        step_b = c2b.selectbox(
            "Step of B", steps_of[1], index=mid(steps_of[1]), key="tl-step-b", help=STEP_HELP
        )
    if chosen is None:
        n = max(len(layer_rows(k, s)) for k, s in zip(sides, (step, step_b), strict=False))
        if n > 3000:
            st.info(f"The step holds {n} kernels: the first 3000 of each side are drawn.")
    fig = figures.timeline(
        ka if chosen is not None else _first(ka, step),
        None if single else (kb if chosen is not None else _first(kb, step_b)),
        chosen,
        step,
        labels,
        step_b=step_b,
    )
    name = "step" if chosen is None else f"layer{chosen}"
    chart(fig, f"timeline_{name}_step{step}", "fig-timeline")
    picked = [(labels[0], ka, step)] + ([] if single else [(labels[1], kb, step_b)])
    where = "the step" if chosen is None else f"layer {chosen}"
    for label, k, s in picked:  # what the bars add up to (analysis.timeline, as the CLI's)
        m = tl.summary(tl.layer_timeline(k, chosen, s))
        if not m["kernels"]:  # a side with nothing to draw is said, not silently missing
            at = "in no step" if s is None else f"in step {s}"
            st.info(f"{label}: no kernel in {where} {at}: nothing of it to draw.")
        if m["kernels"]:
            st.caption(
                f"{label}: {m['kernels']} kernels, span {m['span_us']:.1f} us, busy "
                f"{m['busy_us']:.1f}, idle {m['idle_us']:.1f} (no kernel running), overlap "
                f"{m['overlap_us']:.1f} (kernels resident before the ones before them ended), "
                f"shares {m['shares_us']:.1f} (busy after the previous layer's end: what the "
                "kernels add, each its time after the ones before it ended)"
            )


def layer_rows(k: pa.Table, step: int | None) -> pa.Table:
    return k.filter(pc.is_null(k["step"]) if step is None else pc.equal(k["step"], step))


def _first(k: pa.Table, step: int | None, n: int = 3000) -> pa.Table:
    rows = layer_rows(k, step)
    return rows.sort_by("start_ns").slice(0, n)


def view_kernels(sa: Tables, sb: Tables, labels, single: bool) -> None:
    c1, c2, c3 = st.columns([3, 2, 2])
    query = c1.text_input("Search kernel names", key="k-search", placeholder="e.g. gemm, nccl")
    side = c2.radio(
        "Run", [labels[0]] if single else [labels[0], labels[1]], horizontal=True, key="k-side"
    )
    table = sa["kernels"] if side == labels[0] else sb["kernels"]
    sort = c3.selectbox(
        "Sort by", ["total_us", "calls", "median_us", "max_us", "name"], key="k-sort"
    )
    df = figures.frame(table)
    if query:
        df = df[df["name"].str.contains(query, case=False, regex=False, na=False)]
    df = df.sort_values(sort, ascending=sort == "name", kind="stable")
    st.caption(f"{len(df)} of {table.num_rows} kernel names; click a column header to sort")
    st.dataframe(
        df,
        hide_index=True,
        width="stretch",
        height=_height(len(df), cap=25),
        column_config={
            "share": st.column_config.ProgressColumn(
                "share", format="percent", min_value=0, max_value=1
            ),
            "total_us": _NUM("total (us)", format="%.1f"),
            "median_us": _NUM("median (us)", format="%.2f"),
            "min_us": _NUM("min (us)", format="%.2f"),
            "max_us": _NUM("max (us)", format="%.2f"),
        },
    )
    downloads("kernels", pa.Table.from_pandas(df, preserve_index=False), "dl-kernels")


SETUP_KEYS = ("preset", "gpu", "tp_shape", "tp_world", "batch", "tokens_per_seq")


def setup_of(run: Run) -> tuple:
    """The step a run measured (``SETUP_KEYS``): the runs of one history line share it."""
    return tuple(getattr(run.meta, k) for k in SETUP_KEYS)


def setup_sort_key(setup: tuple) -> tuple:
    """Setups in numeric order, as the README's table: one GPU before two, TP8 before TP16, one
    token per sequence before the verify steps, batch 8 before 32; unknowns last."""
    preset, gpu, tp_shape, tp_world, batch, tps = setup
    key = (preset, gpu, tp_world or 1, tp_shape, tps or 1, batch)
    return tuple((v is None, v if isinstance(v, int | float) else str(v)) for v in key)


def setup_label(setup: tuple) -> str:
    """``kimi-k3 · NVIDIA H200 · TP8 · batch 1x8`` (tp_world where above 1)."""
    preset, gpu, tp_shape, tp_world, batch, tps = setup
    tps = tps or 1
    bits = [
        preset,
        gpu,
        f"TP{tp_shape}" if tp_shape else None,
        f"tp_world {tp_world}" if (tp_world or 1) > 1 else None,
        None if batch is None else (f"batch {batch}x{tps}" if tps > 1 else f"batch {batch}"),
    ]
    return " · ".join(str(b) for b in bits if b) or "(setup not recorded)"


@st.cache_data(show_spinner=False)
def history_points(paths: tuple[tuple[str, float], ...]) -> tuple[pa.Table, list[str]]:
    """One row per (run, layer kind) of a dataset: the run's metadata and its kind_table row;
    and the ids of the runs left out (no kernel attributed to a layer: no row to draw)."""
    parts, left_out = [], []
    for path, stamp in paths:
        run = load_run(path, stamp)
        kt = metrics.kind_table(run.kernels)
        n = kt.num_rows
        m = run.meta
        if n == 0:
            left_out.append(m.run_id)
            continue
        created = m.created_at.isoformat() if m.created_at else None
        meta_cols = {
            "run_id": [m.run_id] * n,
            "created_at": [created] * n,
            "git_commit": [m.git_commit or ""] * n,
            "backend": [m.backend or m.source] * n,
            "setup": [setup_label(setup_of(run))] * n,
        }
        parts.append(pa.table({**meta_cols, **{c: kt[c] for c in kt.column_names}}))
    points = pa.concat_tables(parts, promote_options="default") if parts else pa.table({})
    return points, left_out


def vars_of(run: Run) -> dict[str, Any]:
    return dataclasses.asdict(run.meta)


def view_history(entries: list[Entry], runs: dict[Entry, Run], run_a: Run | None = None) -> None:
    origins = list(dict.fromkeys(e.origin for e in entries))
    origin = st.selectbox("Results dataset", origins, key="h-origin")
    members = [e for e in entries if e.origin == origin and e in runs]
    if len(members) < 2:
        st.info(f"{origin} holds {len(members)} run(s): a history needs two or more.")
        return
    # one setup at a time: a line through batch 1, then batch 64, then TP16 runs is no history
    setups = sorted({setup_of(runs[e]) for e in members}, key=setup_sort_key)
    want = setup_of(run_a) if run_a is not None else None
    setup = st.selectbox(
        "Setup",
        setups,
        index=setups.index(want) if want in setups else 0,
        format_func=setup_label,
        key="h-setup",
        help="the step the runs measured (preset, GPU, TP shape, tp_world, batch x tokens per "
        "sequence); the history draws the runs of one setup, one line per backend and layer kind",
    )
    shown = [e for e in members if setup_of(runs[e]) == setup]
    points, no_layers = history_points(tuple((e.path, _stamp(e.path)) for e in shown))
    notes = []
    if len(shown) < len(members):
        notes.append(
            f"{len(shown)} of the {len(members)} runs of {origin} are of this setup; the "
            f"other {len(members) - len(shown)} (other setups) are left out: pick their setup "
            "above."
        )
    if no_layers:
        notes.append(
            f"{len(no_layers)} run(s) of this setup are left out: no kernel attributed to a "
            f"layer ({', '.join(no_layers[:5])}{', ...' if len(no_layers) > 5 else ''})."
        )
    for note in notes:
        st.caption(note)
    if points.num_rows == 0:
        st.warning("No run of this setup has kernels attributed to a layer: no history to draw.")
        return
    c1, c2, c3, c4, c5 = st.columns(5)
    metric = c1.selectbox(
        "Metric", list(figures.METRICS), index=1, format_func=figures.METRICS.get, key="h-metric"
    )
    x = c2.selectbox("Along", ["created_at", "git_commit"], key="h-x")
    drawn = set(points["run_id"].to_pylist())
    by_id = {runs[e].run_id: runs[e] for e in shown if runs[e].run_id in drawn}
    ordered = sorted(by_id, key=lambda r: str(by_id[r].meta.created_at))
    baseline = c3.selectbox(
        "Baseline", ordered, key="h-base", format_func=lambda r: run_label(by_id[r])
    )
    pct = c4.number_input("Max regression %", 0.0, 1000.0, 5.0, step=1.0, key="h-pct")
    judged = c5.selectbox(
        "Check by",
        list(regress.TIME_METRICS),
        key="h-check",
        help="the time figure the regression check judges beside the kernel count, as "
        "`decodescope check --metric`: span, the layer's share of the step, or both",
    )
    regressed, reasons, unchecked, checked = [], {}, {}, 0
    base = by_id[baseline]
    for rid, run in by_id.items():
        if rid == baseline or not same_setup(vars_of(run), vars_of(base)):
            continue
        try:
            res = regress.check(run, base, pct, metrics=(*regress.TIME_METRICS[judged], "kernels"))
        except ValueError as e:
            unchecked[rid] = str(e)
            continue
        checked += 1
        if not res.ok:
            regressed.append(rid)
            reasons[rid] = res.reasons
    fig = figures.history(points, metric, x=x, baseline=baseline, regressions=regressed)
    chart(fig, "history", "fig-history")
    if regressed:
        st.warning(f"{len(regressed)} run(s) regressed against the baseline (+{pct:g}%):")
        for rid in regressed:
            st.markdown(f"- `{rid}`: " + "; ".join(reasons[rid]))
    else:
        st.success(
            f"No run of the baseline's setup ({', '.join(BASELINE_KEYS)}) regressed beyond "
            f"+{pct:g}% ({checked} run(s) checked)."
        )
    for rid, why in unchecked.items():  # a run the check could not judge is said, not dropped
        st.warning(f"`{rid}` could not be checked against the baseline: {why}")
    _show(points)
    downloads("history", points, "dl-history")


def view_metadata(run_a: Run, run_b: Run, labels, single: bool) -> None:
    runs = [run_a] if single else [run_a, run_b]
    rows = []
    for field, label in META_FIELDS:
        row = {"field": label}
        for lab, run in zip(labels, runs, strict=False):
            v = getattr(run.meta, field)
            row[lab] = "" if v is None else str(v)
        rows.append(row)
    meta = pa.Table.from_pylist(rows)
    _show(meta, height=35 * (len(rows) + 1))
    downloads("run_metadata", meta, "dl-meta")
    for lab, run in zip(labels, runs, strict=False):
        if run.overheads.num_rows:
            with st.expander(f"{lab}: overhead and dropped-record counts"):
                _show(run.overheads.select(["rank", "kind", "count", "detail"]))


# ---- the page ---------------------------------------------------------------------------------


def sidebar_sources() -> tuple[list[Entry], list[str]]:
    problems: list[str] = []
    entries: list[Entry] = []
    for src in requested_sources():
        got, bad = expand(src)
        entries += got
        problems += bad
    st.sidebar.header("Runs")
    uploads = st.sidebar.file_uploader(
        "Add a trace (Kineto .json/.json.gz, nsys .sqlite) or a zipped run folder",
        type=UPLOAD_TYPES,
        accept_multiple_files=True,
        key="upload",
    )
    for up in uploads or []:
        try:
            entries.append(Entry(f"{UPLOADED}{up.name}", save_upload(up.name, up.getvalue())))
        except TraceError as e:
            problems.append(str(e))
        except OSError as e:
            problems.append(f"{up.name}: could not be stored ({e})")
    return entries, problems


def page() -> None:
    st.set_page_config(page_title="decodescope", layout="wide")
    st.title("decodescope: decode layers side by side")
    entries, problems = sidebar_sources()
    runs: dict[Entry, Run] = {}
    for e in entries:
        run, err = try_load(e)
        if err:
            problems.append(err)
        else:
            runs[e] = run
    for p in problems:
        st.error(p)
    if not runs:
        st.warning(
            "No run to show. Start with `decodescope dashboard RUN_OR_DATASET ...` or add a "
            "trace with the uploader in the sidebar."
        )
        return
    loaded = list(runs)
    run_list = [runs[e] for e in loaded]
    da, db = default_pair(run_list)
    names = [f"{i}: {run_label(r)}" for i, r in enumerate(run_list)]
    ia = st.sidebar.selectbox(
        "A", range(len(names)), index=da, format_func=names.__getitem__, key="run-a"
    )
    ib = st.sidebar.selectbox(
        "B", range(len(names)), index=db, format_func=names.__getitem__, key="run-b"
    )
    ea, eb = loaded[ia], loaded[ib]
    run_a, run_b = runs[ea], runs[eb]
    single = ia == ib
    ranks = _choices(run_a.kernels["rank"].to_pylist() + run_b.kernels["rank"].to_pylist())
    rank = (
        st.sidebar.selectbox("Rank", ranks, key="rank")
        if len(ranks) > 1
        else (ranks[0] if ranks else None)
    )
    if DEFAULT_DATA and all(e.origin in {str(p) for p in DEFAULT_DATA} for e in loaded):
        st.sidebar.caption(f"Bundled default data: {', '.join(str(p) for p in DEFAULT_DATA)}")

    labels = ("A", "B")
    # the charts' legends say which path each side is: "A: standard", "B: specialized"
    named = tuple(f"{lab}: {path_name(r)}" for lab, r in zip(labels, (run_a, run_b), strict=True))
    st.caption(f"**A**: {run_label(run_a)}  \n**B**: {run_label(run_b)}")
    if single:
        st.info("A and B are the same run: pick another run for B to compare, or upload one.")
    pa_, pb_ = run_a.meta.preset, run_b.meta.preset
    if not single and pa_ != pb_ and (pa_ or pb_):
        st.warning(
            f"A and B ran different presets ({pa_ or 'unknown'} vs {pb_ or 'unknown'}): their "
            "layers have different shapes, so the comparison is not like for like."
        )
    for lab, run in zip(labels, [run_a] if single else [run_a, run_b], strict=False):
        if run.meta.dropped_records:
            st.warning(
                f"{lab}: CUPTI dropped {run.meta.dropped_records} records: figures may be low."
            )
        if run.meta.partial:
            st.warning(f"{lab}: the run is partial (the capture did not finish).")
        if run.kernels.num_rows == 0:
            st.warning(f"{lab}: the run holds no kernels.")

    sa = Tables(side_table, ea.path, _stamp(ea.path), rank)
    sb = sa if single else Tables(side_table, eb.path, _stamp(eb.path), rank)
    pair = Tables(pair_table, ea.path, _stamp(ea.path), eb.path, _stamp(eb.path), rank)
    lines = figures.headline(sa["kinds"], None if single else sb["kinds"], labels)
    for line in lines:
        st.subheader(line)
    if not lines:
        st.subheader("No layers attributed: see the kernel table")
    elif not single:
        st.markdown("  \n".join(f"**Verdict:** {v}" for v in compare.verdicts(pair["kinds"])))
    if not single:
        from decodescope.ui.cmd_compare import chunk_lines, knob_lines, shape_lines

        for line in shape_lines(run_a, run_b):  # the pair ran different steps: say so first
            st.warning(line)
        knobs = knob_lines(run_a, run_b)
        if knobs:  # an A/B of kernel knobs: say which
            st.caption("  \n".join(line.strip() for line in knobs))
        chunked = chunk_lines(run_a, run_b)
        if chunked:  # a side that re-read its weights per sequence chunk
            st.caption("  \n".join(chunked))

    # lazy tabs: only the open tab's content runs (and travels to the browser)
    tabs = st.tabs(VIEWS, key="view", on_change="rerun")
    views = {
        "Side by side": lambda: (
            view_side_by_side(pair, labels, single),
            view_floor(sa, sb, run_a, run_b, labels, single),
        ),
        "Charts": lambda: view_charts(sa, sb, pair, named, single),
        "Timeline": lambda: view_timeline(run_a, run_b, rank, named, single),
        "Kernels": lambda: view_kernels(sa, sb, labels, single),
        "History": lambda: view_history(entries, runs, run_a),
        "Run metadata": lambda: view_metadata(run_a, run_b, labels, single),
    }
    for name, tab in zip(VIEWS, tabs, strict=True):
        if tab.open:
            with tab:
                views[name]()


def guarded(fn: Callable[[], None]) -> None:
    """Run the page; an unexpected error becomes one message in the page, not a traceback.
    The page's compute time is shown in the sidebar; ``DECODESCOPE_DASHBOARD_PROFILE=FILE``
    writes a cProfile of each run to FILE."""
    import time

    from streamlit.runtime.scriptrunner_utils.exceptions import ScriptControlException

    profile_to = os.environ.get("DECODESCOPE_DASHBOARD_PROFILE")
    prof = None
    if profile_to:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    try:
        fn()
    except ScriptControlException:  # st.stop / st.rerun: Streamlit's own control flow
        raise
    except Exception as e:
        st.error(f"The dashboard hit an error it did not expect: {type(e).__name__}: {e}")
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile_to)
    st.sidebar.caption(f"page computed in {time.perf_counter() - t0:.2f} s")


# streamlit (and AppTest) run this file as "__main__"; importing it (tests, the benchmark) only
# defines the functions
if __name__ == "__main__":
    guarded(page)

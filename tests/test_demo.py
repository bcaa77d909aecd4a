"""`decodescope demo` (the README's first quick-start command) on the bundled real H200 data."""

import subprocess
import sys


def test_demo_shows_the_bundled_captures_layer_by_layer():
    p = subprocess.run(
        [sys.executable, "-m", "decodescope", "demo"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "NVIDIA H200" in out
    assert "per layer kind" in out or "Per layer" in out
    # both layer kinds of the bundled capture are attributed, none left without a layer
    assert "kda" in out and "mla" in out
    # the batch-1 pair's specialized ops against the floors of their own bytes
    flat = " ".join(out.split())
    assert "each op's share against the bytes floor of its own part" in flat
    assert "share - floor us" in flat
    assert "Traceback" not in p.stderr

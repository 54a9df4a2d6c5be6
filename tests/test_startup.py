"""What a command loads: the caches that spare each process Lark's table build and Jinja's
template compilation, and the imports a command does not need (figures: docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT

PROBE = """
import sys
from cgc.cli import main
status = main(sys.argv[1:])
heavy = ('numpy', 'lark', 'cupy', 'torch', 'pygments', 'markdown')
print('loaded:', ' '.join(sorted(m for m in heavy if m in sys.modules)))
sys.exit(status)
"""


def run(tmp_path, *arguments):
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
                   "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", PROBE, *arguments], cwd=ROOT, text=True,
                          capture_output=True, env=environment, timeout=120)


def test_compile_caches_its_tables_and_templates_and_loads_only_what_it_uses(tmp_path):
    out = str(tmp_path / "backward.cu")
    first = run(tmp_path, "compile", "schedules/backward.cg", "-o", out)
    assert first.returncode == 0, first.stderr
    cache = tmp_path / "cache" / "cgc"
    assert any(cache.glob("parser-*.json")), "the parser's table is cached"
    assert len(list((cache / "jinja").iterdir())) >= 10, "the kernels' templates are cached"
    second = run(tmp_path, "compile", "schedules/backward.cg", "-o", out)
    assert second.returncode == 0, second.stderr
    # With the caches warm, compile needs neither Lark nor NumPy.
    assert second.stdout.strip() == "loaded:", second.stdout


def test_an_unwritable_cache_costs_time_not_correctness(tmp_path):
    (tmp_path / "cache").write_text("a file where the cache folder would go")
    result = run(tmp_path, "compile", "schedules/backward.cg", "-o", str(tmp_path / "b.cu"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "b.cu").read_text() == (ROOT / "tests" / "golden" / "cuda" /
                                               "backward.tiny.cu").read_text()

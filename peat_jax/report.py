"""Reports of a run directory: `write_report(run_dir)` writes an HTML page with plots of its
stored results (what ``peat report`` does); `render_report(run_dir)` returns it as a string."""
from peat_jax._src.report import render_report as render_report
from peat_jax._src.report import write_report as write_report

__all__ = ["render_report", "write_report"]

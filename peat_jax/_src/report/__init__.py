"""HTML reports of run directories."""
from peat_jax._src.report.html import render_report, write_report

__all__ = ["render_report", "write_report"]

"""Reports and views of traces and plans: the per-trace memory report, the compare table, the plots."""

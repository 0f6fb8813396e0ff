"""The checks: each a DuckDB query over the quality tables that judges one defect (registry.py lists them and runs them all)."""

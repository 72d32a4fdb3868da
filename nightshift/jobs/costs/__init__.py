"""Costs: per-request accounting, a batch's cost report (stored at finalize or live), spend
per project per day, and how reports are shown (terminal table and HTML page)."""

"""Pictures (plots.py) and live notebook views (widgets.py)."""

"""Pictures (plots.py), live notebook views (widgets.py), the fragmentation visualizer's allocator
simulator (fragmentation.py) and each notebook's key figure (figures.py, ``make figures``)."""

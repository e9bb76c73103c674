"""The runtime every engine shares, rungs 0-13 alike: the engine interface (``interface.py``:
``Engine``, ``StepOutput``, the methods views may call), the one run loop (``driver.py``), what
views watch inside a step (``observe.py``) and how options become configs (``config.py``).

It knows no engine: the paged core (``minillm/core``) and the rungs build on it."""

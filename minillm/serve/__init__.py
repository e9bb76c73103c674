"""Online serving: an OpenAI-compatible server around one engine (``python -m minillm serve``).

``loop.py`` (one thread owns the engine), ``protocol.py`` (the wire format), ``app.py`` (the HTTP
endpoints), ``detok.py`` (token ids -> streamed text, stop strings), ``metrics.py`` (``/metrics``),
``dashboard.py`` (the live batch view), ``loadgen.py`` (``python -m minillm bench --serve``).
Notebook 02 teaches continuous batching offline; this is the same engine, fed by live clients.
"""

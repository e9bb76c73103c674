"""The JSONL files of ``python -m minillm generate``: each input line parsed into what to generate
(or its error), each output row written, the file replaced atomically (``__main__.py`` runs them)."""
from __future__ import annotations

import errno
import json
import os
import tempfile
from dataclasses import dataclass

# JSONL fields a generate line may carry, and their types
LINE_FIELDS = {"id": (str, int), "messages": list, "prompt": str, "prompt_token_ids": list,
               "max_tokens": int, "temperature": (int, float), "top_p": (int, float),
               "top_k": int, "seed": int, "n": int, "beam_width": int, "priority": int,
               "ignore_eos": bool, "presence_penalty": (int, float),
               "frequency_penalty": (int, float), "repetition_penalty": (int, float),
               "min_p": (int, float), "min_tokens": int, "logit_bias": dict, "lora": str}
PARAM_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "beam_width",
                "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "min_p", "min_tokens", "logit_bias")


@dataclass
class Line:
    """One non-blank input line: its id, and either an error or what to generate."""

    lineno: int
    id: object
    error: str | None = None
    spec: tuple | None = None   # (prompt, SamplingParams kwargs, extras)

    @property
    def request_id(self) -> str:
        return f"line-{self.lineno}"


def load_json(lineno: int, raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        why = f"not valid UTF-8 (byte 0x{e.object[e.start]:02x} at column {e.start + 1})"
    except json.JSONDecodeError as e:
        why = f"invalid JSON ({e.msg})"
    except RecursionError:
        why = "invalid JSON (nested too deeply)"
    except ValueError as e:   # e.g. an integer literal too long to convert
        why = f"invalid JSON ({e})"
    raise ValueError(f"line {lineno}: {why}")


def parse_line(lineno: int, obj, defaults: dict) -> tuple[object, dict, dict]:
    """A decoded JSONL line -> (prompt, SamplingParams kwargs, extras); ValueError says why not."""
    if not isinstance(obj, dict):
        raise ValueError(f"line {lineno}: expected a JSON object")
    unknown = sorted(set(obj) - set(LINE_FIELDS))
    if unknown:
        raise ValueError(f"line {lineno}: unknown field(s) {', '.join(unknown)}")
    for key, value in obj.items():
        typ = LINE_FIELDS[key]
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
            raise ValueError(f"line {lineno}: field {key!r} has the wrong type "
                             f"({type(value).__name__})")
    sources = [k for k in ("messages", "prompt", "prompt_token_ids") if k in obj]
    if len(sources) != 1:
        raise ValueError(f"line {lineno}: needs exactly one of messages, prompt, prompt_token_ids")
    params = {**defaults, **{k: obj[k] for k in PARAM_FIELDS if k in obj}}
    if "logit_bias" in params:     # JSON keys are strings: "50256" is token 50256
        params["logit_bias"] = {int(k) if k.isdigit() else k: v
                                for k, v in params["logit_bias"].items()}
    extras = {"priority": obj.get("priority", 0), "lora": obj.get("lora")}   # lora: rung 13
    return {sources[0]: obj[sources[0]]}, params, extras


def echo_id(lineno: int, obj) -> object:
    """The id a line's output row carries: its "id" when that is a string or an integer, else its
    line number. An id of another kind is the line's error: JSON's decoder accepts NaN, Infinity
    and 1e999 (a float that overflows), which no JSON writer may write back."""
    if not isinstance(obj, dict) or "id" not in obj:
        return lineno
    value = obj["id"]
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"line {lineno}: field 'id' must be a string or an integer, got "
                     f"{json.dumps(value, allow_nan=True)[:40]}")


def read_lines(path: str, defaults: dict) -> list[Line]:
    """Parse each non-blank line of the JSONL file ``path`` (OSError if it cannot be read); a bad
    line (not UTF-8, not JSON, wrong fields) gets its error. A leading UTF-8 BOM is dropped."""
    with open(path, "rb") as f:
        data = f.read().removeprefix(b"\xef\xbb\xbf")
    lines = []
    for lineno, raw in enumerate(data.splitlines(), 1):
        if not raw.decode("utf-8", "replace").strip():
            continue
        line = Line(lineno, lineno)
        try:
            obj = load_json(lineno, raw)
            line.id = echo_id(lineno, obj)
            line.spec = parse_line(lineno, obj, defaults)
        except ValueError as e:
            line.error = str(e)
        lines.append(line)
    return lines


def output_row(line: Line, out, unfinished: str = "interrupted before it finished") -> dict:
    """``line``'s output row: its result, or its error; ``out`` is None for a line whose request
    never finished, which gets the error ``unfinished`` (why the run stopped)."""
    if line.error:
        return {"id": line.id, "error": line.error}
    if out is None:
        return {"id": line.id, "error": f"line {line.lineno}: {unfinished}"}
    if out.error:   # engine errors start with the request id, "line-N: "
        return {"id": line.id, "error": f"line {line.lineno}: "
                                        f"{out.error.removeprefix(line.request_id + ': ')}"}
    row = {"id": line.id, "text": out.text, "token_ids": out.token_ids,
           "finish_reason": out.finish_reason.value, "ttft_s": out.ttft_s,
           "latency_s": out.latency_s}
    if len(out.samples) > 1:
        row["samples"] = out.samples
    return row


def write_rows(path: str, rows, check_only: bool = False) -> None:
    """Write JSONL rows atomically: a temp file beside ``path`` (a symlink's target), renamed onto
    it once complete; a device or pipe (``/dev/null``) is written in place. ``check_only``: just
    create and remove that temp file, so an OSError says now, before any work, that we can't."""
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "Is a directory")
    if os.path.exists(path) and not os.path.isfile(path):
        if not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, "Permission denied")
        if not check_only:   # (opening a pipe would wait for its reader)
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, allow_nan=False) + "\n" for row in rows)
        return
    path = os.path.realpath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, allow_nan=False) + "\n" for row in rows)
            f.flush()
            os.fsync(f.fileno())
        if not check_only:
            umask = os.umask(0o022)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)   # mkstemp made it 0600: give it a new file's mode
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

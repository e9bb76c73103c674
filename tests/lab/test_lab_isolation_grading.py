"""The issue's cheats and stalls, planted in students' files and graded end to end (``check``, as
``lab check`` and ``grade --class`` do): each is rejected with its reason, the next student's
grading is unaffected, the teacher's files are unchanged, and nothing is left behind."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from minillm.lab.exercises import EXERCISES
from minillm.lab.grade import check, start, teacher_files
from minillm.lab.jail import isolation

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
EX = EXERCISES["08"]

# Each read escape of the issue, tried at import; the first that yields the reference's source
# binds its functions (a cheat that passes if any escape works).
READERS = f'''
import ctypes, glob, os, subprocess
_REPO, _REL = {str(REPO)!r}, "minillm/engines/r8_policies/policy.py"
_tries = {{}}

def _git():
    return subprocess.run(["sh", "-c", "cd " + os.path.dirname(_REPO) + " && cd "
                           + os.path.basename(_REPO) + " && git show HEAD:" + _REL],
                          capture_output=True, text=True).stdout

def _env_cat():
    return subprocess.run(["sh", "-c", 'cat "$P/' + _REL + '"'], capture_output=True, text=True,
                          env={{"P": os.environ.get("MINILLM_LAB_FORBIDDEN") or _REPO}}).stdout

def _dir_fd():
    fd = os.open(os.path.dirname(_REPO), os.O_RDONLY)
    return os.read(os.open(os.path.basename(_REPO) + "/" + _REL, os.O_RDONLY, dir_fd=fd),
                   1 << 20).decode()

def _libc():
    libc = ctypes.CDLL("libc.so.6")
    fd = libc.open((_REPO + "/" + _REL).encode(), 0)
    return os.read(fd, 1 << 20).decode() if fd >= 0 else ""

def _hard_link():
    dst = _REPO + "/minillm/lab/graders/_policy.py"
    ctypes.CDLL("libc.so.6").link((_REPO + "/" + _REL).encode(), dst.encode())
    return open(dst).read()

def _parent_memory():
    for p in filter(str.isdigit, os.listdir("/proc")):
        if b"_bootstrap" in open("/proc/" + p + "/cmdline", "rb").read():
            open("/proc/" + p + "/mem", "rb").read(1)
            return "class Priority"      # it could: the results could be forged
    return ""

for _try in (_git, _env_cat, _dir_fd, _libc, _hard_link, _parent_memory):
    try:
        _src = _try()
    except Exception as e:
        _src = ""
        _tries[_try.__name__] = type(e).__name__
    if "class Priority" in _src:
        exec(_src, globals())
        break
import sys
print("escapes tried:", _tries, file=sys.stderr)
'''

# A grader rewritten, a detached watcher left to rewrite it later and to forge the next grading.
WRITERS = f'''
import ctypes, os, subprocess
_G = {str(EX.grader)!r}
for _path in (_G, {str(EX.grader.with_name("conftest.py"))!r}):
    try:
        with open(_path, "a") as f:
            f.write("\\ndef test_anything():\\n    pass\\n")
    except Exception:
        ctypes.CDLL("libc.so.6").open(_path.encode(), os.O_WRONLY | os.O_APPEND)
subprocess.Popen(["sh", "-c", "for i in $(seq 600); do echo '# forged' >> $G; sleep 0.5; "
                  "done # minillm-forger"], env={{"G": _G}}, start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
'''


def skeleton(tmp_path) -> str:
    return start(EX, tmp_path / "fresh", force=True).read_text()


def after_future(source: str, code: str) -> str:
    head, sep, rest = source.partition("from __future__ import annotations\n")
    return head + sep + code + rest


def graded(tmp_path, name: str, source: str, *args: str, **options):
    path = tmp_path / name / EX.file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return check(EX, path, args, capture=True, **options)


def _alive(marker: bytes) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            pass
    return False


@pytest.mark.skipif("not isolation()[0]", reason="no namespaces on this machine")
def test_every_read_escape_scores_zero(tmp_path):
    done = graded(tmp_path, "mallory", after_future(skeleton(tmp_path), READERS), "-x")
    assert done.returncode != 0 and "not written yet" in done.stdout, done.stdout[-3000:]
    assert "isolated: yes" in done.stdout
    assert done.review["lines"], "the escapes' lines are listed for the teacher"


@pytest.mark.skipif("not isolation()[0]", reason="no namespaces on this machine")
def test_a_rewritten_grader_and_a_watcher_do_not_touch_the_next_grading(tmp_path):
    before = teacher_files(EX.grader)
    done = graded(tmp_path, "mallory", after_future(skeleton(tmp_path), WRITERS), "-x")
    assert done.returncode != 0 and "not written yet" in done.stdout, done.stdout[-3000:]
    assert done.tampered == [] and teacher_files(EX.grader) == before
    assert not _alive(b"minillm-forger"), "the watcher outlived the grading"
    nxt = graded(tmp_path, "next", skeleton(tmp_path), "-x")        # the next student: blank
    assert nxt.returncode != 0 and "not written yet" in nxt.stdout, nxt.stdout[-3000:]
    assert teacher_files(EX.grader) == before


@pytest.mark.parametrize("case", ["hang at import", "garbage", "flood"])
def test_stalls_end_within_a_minute_of_their_limit_leaving_nothing(case, tmp_path, monkeypatch,
                                                                   capsys):
    """A 600 s sleep at import (limit 15 s here), 8 bytes of garbage on the answer channel, 1 GiB
    of output: each grading ends well within a minute of its limit, fails with the reason, and
    leaves no process and no folder (the grading's temporary folder is watched)."""
    code = {"hang at import": "import time\ntime.sleep(600)\n",
            "garbage": "import os\nos.write(3, b'garbage!')\n",
            "flood": "import sys\n_c = 'x' * (1 << 20)\nfor _ in range(1024):\n"
                     "    sys.stderr.write(_c)\n"}[case]
    # 15 s where the import hangs (it only has to outlast the limit), 30 where it must finish on
    # a busy machine
    import_limit = 15 if case == "hang at import" else 30
    why = {"hang at import": f"took over {import_limit} s to import", "garbage": "over the limit",
           "flood": "of output and was stopped"}[case]
    monkeypatch.setenv("MINILLM_LAB_IMPORT_LIMIT_S", str(import_limit))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    source = after_future(EX.source_path.read_text(), code)
    t = time.monotonic()
    done = graded(tmp_path, "dos", source, test_limit_s=120)
    took = time.monotonic() - t
    assert done.returncode != 0 and why in done.stdout, done.stdout[-3000:]
    assert took < import_limit + 120, took  # generous: "judged at all", not a speed
    assert list((tmp_path / "tmp").iterdir()) == [], "a temporary folder left behind"
    assert not _alive(str(tmp_path).encode()), "a process left behind"
    with capsys.disabled():
        print(f"\n{case}: graded in {took:.0f} s ({'isolated' if isolation()[0] else 'not'})")

"""``python -m minillm.lab``: list, start and check the exercises; the answer key; notebook timings."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .exercises import EXERCISES, get


def cmd_list(_args) -> int:
    print("exercise       minutes  notebook               what you write")
    for ex in EXERCISES.values():
        print(f"{ex.id:14s} {ex.minutes:>7d}  {ex.notebook:22s} {ex.title}")
        print(f"{'':46s}{ex.module}: {', '.join(ex.functions)}")
    print("\nstart one with: python -m minillm.lab start <exercise>")
    return 0


def cmd_start(args) -> int:
    from .grade import start
    ex = get(args.exercise)
    path = start(ex, Path(args.dir), force=args.force)
    print(f"wrote {path}\n\nWrite the bodies marked TODO ({', '.join(ex.functions)}). The idea "
          f"is taught in notebooks/{ex.notebook}.ipynb.\nHint: {ex.hint}\n\nThen grade it:\n"
          f"    python -m minillm.lab check {ex.id}" +
          (f" --dir {args.dir}" if args.dir != "labwork" else ""))
    return 0


def cmd_check(args) -> int:
    from .grade import check, student_file
    ex = get(args.exercise)
    path = None if args.reference else Path(args.file) if args.file else \
        student_file(ex, Path(args.dir))
    who = "the package's own code (the reference)" if path is None else str(path)
    # from the work folder, the student's other exercises stand in too: in a handout the
    # package's own copies of those functions are stubs
    also = {} if args.reference or args.file else {
        e.module: f for e in EXERCISES.values()
        if e.module != ex.module and (f := student_file(e, Path(args.dir))).exists()}
    print(f"grading exercise {ex.id} ({ex.title}) on {who}…", flush=True)
    rc = check(ex, path, tuple(args.pytest_args), graders=args.graders, also=also).returncode
    if rc == 0:
        print(f"\n✓ exercise {ex.id} passes: the engine runs your code and gets the right answers.")
    else:
        print(f"\n✗ exercise {ex.id} is not done yet: read the first failure above (its message "
              f"says what the engine expected).\nHint: {ex.hint}")
    return 0 if rc == 0 else 1


def cmd_grade(args) -> int:
    from .teacher import grade_class, table
    exercises = [e.strip() for e in args.exercises.split(",") if e.strip()] or list(EXERCISES)
    for e in exercises:
        get(e)
    grades = grade_class(Path(args.class_dir), exercises, Path(args.out), args.limit_s,
                         allow_unisolated=args.allow_unisolated)
    print(table(grades))
    print(f"wrote {Path(args.out).with_suffix('.csv')} and {Path(args.out).with_suffix('.xml')}")
    return 0


def cmd_handout(args) -> int:
    from .teacher import handout
    exercises = [e.strip() for e in args.exercises.split(",") if e.strip()] or list(EXERCISES)
    for e in exercises:
        get(e)
    out = handout(Path(args.out), exercises, with_graders=args.with_graders)
    shipped = "the graders in lab-graders/ (students see the tests)" if args.with_graders else \
        "no graders"
    print(f"wrote the students' repository to {out}: exercises {', '.join(exercises)} as stubs; "
          f"{shipped}; no tests, answer key or history. Students read docs/STUDENTS.md. Grade "
          "with `lab grade --class` here.")
    return 0


def cmd_answers(_args) -> int:
    if not (Path(__file__).parent / "graders").is_dir():
        print("this copy is a handout: the key stays with the teacher")
        return 2
    from .questions import QUESTIONS
    print("The key to the notebooks' numeric questions (computed now, from the engine):")
    for q in QUESTIONS.values():
        print(f"  {q.id:7s} {q.truth()!r:>14}   {q.text}")
    return 0


def cmd_timings(args) -> int:
    from .timings import main
    return main(full=args.full, only=args.only, json_path=args.json, html_dir=args.html)


def cmd_export(args) -> int:
    from .timings import main
    return main(full=not args.quick, only=args.only, json_path=args.json, html_dir=args.out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minillm.lab", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the exercises").set_defaults(fn=cmd_list)
    s = sub.add_parser("start", help="write an exercise's skeleton into labwork/<id>/")
    s.add_argument("exercise", help=f"one of {', '.join(EXERCISES)}")
    s.add_argument("--dir", default="labwork", help="work folder (default: labwork)")
    s.add_argument("--force", action="store_true", help="overwrite your file with a fresh skeleton")
    s.set_defaults(fn=cmd_start)
    c = sub.add_parser("check", help="grade an exercise")
    c.add_argument("exercise", help=f"one of {', '.join(EXERCISES)}")
    c.add_argument("--dir", default="labwork", help="work folder (default: labwork)")
    c.add_argument("--file", help="grade this file instead of labwork/<id>/<module>.py")
    c.add_argument("--reference", action="store_true",
                   help="grade the package's own code (the reference solution)")
    c.add_argument("--graders", help="a folder of graders (a teacher's; a handout has none)")
    c.add_argument("pytest_args", nargs="*", help="passed to pytest (after --), e.g. -- -x")
    c.set_defaults(fn=cmd_check)
    g = sub.add_parser("grade", help="teacher: grade a class (one folder per student)")
    g.add_argument("--class", dest="class_dir", required=True,
                   help="a folder of student folders, each laid out as `start` writes")
    g.add_argument("--exercises", default="", help="comma-separated (default: all)")
    g.add_argument("--out", default="grades", help="writes OUT.csv and OUT.xml (JUnit)")
    g.add_argument("--limit-s", type=int, default=1200,
                   help="time limit per student and exercise, seconds")
    g.add_argument("--allow-unisolated", action="store_true",
                   help="grade even where the students' code cannot run isolated (no Linux "
                        "namespaces): every row then says isolated: no")
    g.set_defaults(fn=cmd_grade)
    h = sub.add_parser("handout", help="teacher: write the students' repository")
    h.add_argument("out", help="a new folder")
    h.add_argument("--exercises", default="", help="comma-separated (default: all)")
    h.add_argument("--with-graders", action="store_true",
                   help="ship the graders (lab-graders/) so that students can run `lab check`")
    h.set_defaults(fn=cmd_handout)
    sub.add_parser("answers", help="the teacher's key to the numeric questions") \
        .set_defaults(fn=cmd_answers)
    t = sub.add_parser("timings", help="run the notebooks headless and time each section")
    t.add_argument("--full", action="store_true", help="full mode (default: quick mode)")
    t.add_argument("--only", default="", help="comma-separated notebook prefixes, e.g. 00,03")
    t.add_argument("--json", help="also write the numbers to this file")
    t.add_argument("--html", help="also write each executed notebook as HTML into this folder")
    t.set_defaults(fn=cmd_timings)
    x = sub.add_parser("export", help="run every notebook (full mode) and keep HTML copies with "
                                      "every figure in notebooks/html/")
    x.add_argument("--out", default="notebooks/html", help="folder (default: notebooks/html)")
    x.add_argument("--quick", action="store_true", help="quick mode (tiny runs)")
    x.add_argument("--only", default="", help="comma-separated notebook prefixes, e.g. 00,03")
    x.add_argument("--json", help="also write the timings to this file")
    x.set_defaults(fn=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []   # pytest's, wherever -- falls
    parser = build_parser()
    args = parser.parse_args(argv[:len(argv) - len(extra) - 1] if "--" in argv else argv)
    if extra and args.command != "check":
        parser.error(f"arguments after -- are pytest's and only `check` takes them: {extra}")
    if args.command == "check":
        args.pytest_args = [*args.pytest_args, *extra]
    try:
        return args.fn(args)
    except KeyboardInterrupt:     # the grading processes and the students' are killed by then
        print(f"\ninterrupted: `lab {args.command}` stopped before it finished", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

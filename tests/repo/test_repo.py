"""The repository keeps its promises: CI runs the README's test command, torch stays pinned."""
import pathlib
import subprocess
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Run the tests.*?```bash\n(.*?)```", readme, re.S).group(1)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in block.strip().splitlines():
        for part in command.split("&&"):
            assert part.strip() in ci_lines, f"README test step {part.strip()!r} is not in .ci/run"


def test_torch_is_pinned_to_the_cpu_wheel():
    reqs = (ROOT / "requirements.txt").read_text().splitlines()
    assert "torch==2.13.0" in reqs
    assert all(re.match(r"^[A-Za-z0-9_.\-]+==[\w.]+$", r) for r in reqs if r and not r.startswith("#"))


# Text a public reader cannot resolve: references to the project's own tracker, work log, design notes or
# commits, and changelog voice. Another project's issue ("DeepSpeed issue 4354") is a citation, not history.
HISTORY = [re.compile(p, re.I) for p in (
    r"\bissues? #?\d+", r"\bstop #?\d+\b", r"\bDESIGN(\.md)? ?§", r"\bcommit [0-9a-f]{7,40}\b",
    r"\b(the|a) previous (sandbox|session|version|readme|study script)\b", r"\b(this|a later|earlier) session\b")]
TEXT_SUFFIXES = (".py", ".md", ".sh", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".toml")
ORDINARY = {"The", "In", "See", "This", "That", "An", "A", "Our", "For", "By", "Its", "As"}


def history_hits(text):
    """[(line number, matched text)] of process history in `text`."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in HISTORY:
            for m in pattern.finditer(line):
                before = [w.strip("(\"'[`") for w in line[:m.start()].split()]
                if m.group(0).lower().startswith("issue") and before and before[-1][:1].isupper() \
                        and before[-1] not in ORDINARY:
                    continue                                  # another project's issue tracker
                hits.append((number, m.group(0)))
    return hits


def tracked_text_files():
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):            # not a git checkout: every file but the usual
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and not {".git", ".venv", "runs"} & set(p.relative_to(ROOT).parts)]
    for name in names:
        path = ROOT / name
        if name.startswith("docs/study/runs/") or not path.is_file():
            continue
        if name.endswith(TEXT_SUFFIXES) or path.read_bytes()[:2] == b"#!":
            yield name, path


def test_the_history_scan_finds_what_it_should():
    issue, design, commit, stop = "iss" + "ue", "DES" + "IGN", "com" + "mit", "st" + "op"   # not hits themselves
    text = (f"fine line\nbuilt for {issue} 11's question\nas {design} §5 says\nfixed in {commit} fb266ff\n"
            f"confirms {stop} 9's run\nDeepSpeed {issue} 4354 reports it\nthe previous sand" "box leaked\n")
    assert [n for n, _ in history_hits(text)] == [2, 3, 4, 5, 7]
    assert history_hits("stops up to three numbers early; commit to it; an issue with 3 rows") == []
    assert history_hits(f"(TRL {issue} 12) and In {issue} 12") == [(1, f"{issue} 12")]


def test_no_process_history_in_the_repository_text():
    hits = [f"{name}:{number}: {match!r}" for name, path in tracked_text_files()
            for number, match in history_hits(path.read_text(errors="replace"))]
    assert not hits, "process history a public reader cannot resolve:\n" + "\n".join(hits)


def test_every_doc_is_reachable_from_the_readme_and_every_local_link_resolves():
    link = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
    seen, todo, broken = set(), [ROOT / "README.md"], []
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for target, _ in link.findall(line):
                if target.startswith(("http://", "https://", "mailto:")):
                    continue
                path = (page.parent / target).resolve()
                if not path.exists():
                    broken.append(f"{page.relative_to(ROOT)}:{number}: {target}")
                elif path.suffix == ".md":
                    todo.append(path)
    assert not broken, "links to missing files:\n" + "\n".join(broken)
    docs = {p.resolve() for p in (ROOT / "docs").rglob("*.md") if "runs" not in p.relative_to(ROOT).parts}
    assert docs <= seen, f"not reachable from README.md: {sorted(str(p.relative_to(ROOT)) for p in docs - seen)}"


def test_same_numbers_compares_the_references_metrics_and_lists_new_ones_apart():
    """bench/same_numbers.py: a metric the working tree adds is new, not a difference; a changed or missing one
    of the reference's is; timings are never compared."""
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    from same_numbers import differences
    before = [{"step": 1, "kl": 0.5, "time/step": 1.0}, {"step": 2, "kl": 0.25, "eval/rm": 1.0}]
    after = [{"step": 1, "kl": 0.5, "time/step": 2.0, "eval/distinct_2": 0.9}, {"step": 2, "kl": 0.25, "eval/rm": 1.0}]
    assert differences(before, after) == ([], ["eval/distinct_2"])
    after[1] = {"step": 2, "kl": 0.3}
    assert differences(before, after) == (["iteration 2: eval/rm 1.0 -> missing", "iteration 2: kl 0.25 -> 0.3"],
                                          ["eval/distinct_2"])
    assert differences(before, after[:1])[0] == ["2 iterations before, 1 after"]


def flag_table(doc, heading):
    """The flags named in the first column of the markdown table that follows `heading` in `doc`."""
    section = doc[doc.index(heading):]
    table = section[section.index("| flag"):]
    table = table[:table.index("\n\n")] if "\n\n" in table else table
    return {flag for line in table.splitlines() if line.startswith("|")
            for flag in re.findall(r"`--(\w+)", line.split("|")[1])}


def test_every_flag_has_a_one_line_help_and_every_ppo_flag_a_row_in_the_training_docs_flag_table():
    """Every stage's help is one line (<= 100 characters); the long story of ppo.py's flags is docs/training.md's
    flag table, which names every field and nothing else."""
    import dataclasses

    import evaluate
    import ppo
    import reward_model
    import sft
    for cls in (*ppo.ARGS, sft.SFTArgs, reward_model.RMArgs, evaluate.EvalArgs):
        too_long = {f.name: len(f.metadata["help"]) for f in dataclasses.fields(cls)
                    if len(f.metadata["help"]) > 100 or "\n" in f.metadata["help"]}
        assert not too_long, f"{cls.__name__}: help over 100 characters: {too_long}"
    doc = (ROOT / "docs" / "training.md").read_text()
    assert flag_table(doc, "**Flags** (`python ppo.py --help`") == {f.name for c in ppo.ARGS for f in dataclasses.fields(c)}


def test_the_files_a_reader_follows_keep_their_lines_and_sizes():
    """The tutorial core reads in a window: no line over 120 characters in the stage files, macro_actions.py, data.py
    and evaluate.py; ppo.py at most 450 lines and 36 KB, its main() at most 90 lines, no function over 50 but main,
    its PPOArgs at most 40 flags (each extension's in a dataclass of its own, ppo.ARGS)."""
    import ast
    import dataclasses
    import ppo
    for name in ("ppo.py", "macro_actions.py", "sft.py", "reward_model.py", "data.py", "evaluate.py"):
        long = [n for n, line in enumerate((ROOT / name).read_text().splitlines(), 1) if len(line) > 120]
        assert not long, f"{name}: lines over 120 characters: {long}"
    source = (ROOT / "ppo.py").read_text()
    assert len(source.splitlines()) <= 450 and len(source.encode()) <= 36_000
    lengths = {f.name: f.end_lineno - f.lineno + 1 for f in ast.parse(source).body if isinstance(f, ast.FunctionDef)}
    assert lengths.pop("main") <= 90 and lengths["ppo_update"] <= 40 and max(lengths.values()) <= 50, lengths
    assert len(dataclasses.fields(ppo.PPOArgs)) <= 40 and ppo.ARGS[0] is ppo.PPOArgs


def test_the_readmes_first_screen_is_the_pitch_the_picture_and_the_quick_start():
    """A newcomer meets what it is, the picture and how to run it before any of the study's statistics: the Quick
    start heading within the first 20 lines, the picture above it, no verdict word of the study above it."""
    import re
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("## Quick start")
    above = "\n".join(lines[:start]).lower()
    assert start < 20 and "![" in above and (ROOT / re.search(r"\]\((docs/[^)]+\.png)\)", above).group(1)).exists()
    assert not [w for w in ("undecided", "level", "detectable effect") if re.search(rf"(?<![-\w]){w}\b", above)]
    assert len(re.findall(r"\d+\.\d+|\d+%", above)) <= 3
    assert "reward model" in "\n".join(lines[start:start + 12]).lower()    # it says it builds the SFT model and the RM

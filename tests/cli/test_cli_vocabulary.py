"""The CLI's vocabulary (issue 19, point 9; docs/cli.md, "Vocabulary"): a flag means one thing in every
command, the flags several commands take are defined once (parent parsers, gpusd.cli.options), a renamed
flag's old spelling still works for one release with a one-line note, ``gpusd --help`` lists the commands
in the groups of docs/cli.md, and each command's parser is built from its own module alone."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpusd.cli import COMMANDS, GROUPS, build_parser

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

# Every (sub)command, as the words that name it.
NESTED = {"export": ("prometheus-sd", "dns-sd-zone"), "slurm": ("conf", "prolog", "epilog"), "ray": ("up", "down")}
ALL = [(c,) if c not in NESTED else (c, s) for c in COMMANDS for s in NESTED.get(c, ("",))]


def _parser(words: tuple[str, ...]) -> argparse.ArgumentParser:
    p = build_parser(words[0])
    for word in words:
        action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = action.choices[word]
    return p


def _options(words: tuple[str, ...]) -> dict[str, argparse.Action]:
    """The listed flags of a (sub)command: option string -> action (hidden deprecated aliases left out)."""
    return {opt: a for a in _parser(words)._actions if a.help != argparse.SUPPRESS for opt in a.option_strings}


# (old argv, new argv, dest, value): each renamed flag
RENAMED = [
    (["scan", "--timeout", "1.5"], ["scan", "--browse", "1.5"], "browse", 1.5),
    (["list", "--timeout", "1.5"], ["list", "--browse", "1.5"], "browse", 1.5),
    (["list_devices", "--timeout", "1.5"], ["list_devices", "--browse", "1.5"], "browse", 1.5),
    (["export", "dns-sd-zone", "--domain", "lab.example", "--timeout", "4"],
     ["export", "dns-sd-zone", "--domain", "lab.example", "--browse", "4"], "browse", 4.0),
    (["top", "--wait", "6"], ["top", "--browse", "6"], "browse", 6.0),
    (["export", "prometheus-sd", "--wait", "2m"], ["export", "prometheus-sd", "--browse", "2m"], "browse", 120.0),
    (["slurm", "conf", "--wait", "4"], ["slurm", "conf", "--browse", "4"], "browse", 4.0),
    (["start", "--history", "60"], ["start", "--sample-window", "60"], "history", 60.0),
    (["start", "--fleet", "off"], ["start", "--fleet-view", "off"], "fleet", "off"),
    (["launch", "-o", "A=b", "-o", "C=d", "command", "--", "true"],
     ["launch", "--ssh-option", "A=b", "--ssh-option", "C=d", "command", "--", "true"], "ssh_option", ["A=b", "C=d"]),
    (["ray", "up", "-o", "A=b"], ["ray", "up", "--ssh-option", "A=b"], "ssh_option", ["A=b"]),
]


@pytest.fixture(autouse=True)
def _fresh_notes():
    from gpusd.cli import options

    options._told.clear()
    yield
    options._told.clear()


@pytest.mark.parametrize("old, new, dest, value", RENAMED, ids=[" ".join(old[:3]) for old, *_ in RENAMED])
def test_a_renamed_flag_keeps_its_old_spelling_with_a_one_line_note(old, new, dest, value, capsys) -> None:
    args = build_parser(old[0]).parse_args(old)
    assert getattr(args, dest) == value
    err = capsys.readouterr().err
    flag = next(w for w in old if w.startswith("-") and w not in new)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert f"{flag} is now {next(w for w in new if w.startswith('-') and w not in old)}" in err, err
    assert "0.4" in err and "docs/cli.md" in err, err
    # the new spelling: the same value, and no note
    assert getattr(build_parser(new[0]).parse_args(new), dest) == value
    assert capsys.readouterr().err == ""
    # the old spelling is hidden from the command's help
    words = tuple(w for w in old if not w.startswith("-"))[:2 if old[0] in NESTED else 1]
    assert flag not in _options(words) and not re.search(rf"{flag}(?![-\w])", _parser(words).format_usage())


def test_the_note_is_printed_once_per_process_and_through_main(capsys) -> None:
    """gpusd start parses its argv again to find the flags given (cli/daemon.py): one note still."""
    build_parser("scan").parse_args(["scan", "--timeout", "1"])
    build_parser("scan").parse_args(["scan", "--timeout", "1"])
    assert capsys.readouterr().err.count("is now --browse") == 1


def test_a_bad_value_under_the_old_spelling_names_that_spelling(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser("top").parse_args(["top", "--once", "--wait", "-1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --wait:" in err and "is now" not in err, err


def test_the_deprecated_spellings_are_documented() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text[text.index("## Vocabulary"):]
    section = section[:section.index("\n## ", 4)]
    table = section[section.index("| old spelling |"):].split("\n\n")[0].splitlines()[2:]
    for old, new, _, _ in RENAMED:
        gone = next(w for w in old if w.startswith("-") and w not in new)
        now = next(w for w in new if w.startswith("-") and w not in old)
        cells = [re.split(r"(?<!\\)\|", r) for r in table]  # a cell may hold an escaped \|
        rows = [c for c in cells if re.search(rf"{gone}(?![-\w])", c[1]) and old[0] in c[1]]
        assert len(rows) == 1 and now in rows[0][2], (gone, now)


# the flags of the shared groups (gpusd.cli.options): the same definition wherever they appear
SHARED = ("--interface", "--session", "--all-sessions", "--state-dir", "--peer", "--peers-file", "--dns-sd-domain",
          "--dns-server", "--host", "--model", "--simulate", "--ttl", "--wait", "--timeout", "--browse",
          "--threshold", "--thresholds", "--identity", "--min-free", "--include", "--by", "--vendor", "--ssh-option")
# where a shared word is another command's own flag, with the same meaning (docs/cli.md, "Vocabulary")
OWN = {("--ttl", ("export", "dns-sd-zone")),  # the DNS records' TTL: an int of seconds
       ("--min-free", ("list",)), ("--min-free", ("list_devices",)), ("--min-free", ("watch",)),  # an amount only
       ("--timeout", ("start",)), ("--timeout", ("stop",)), ("--timeout", ("slurm", "prolog")),
       ("--timeout", ("slurm", "epilog")),  # the wait of that command, not of --wait
       ("--timeout", ("notify",)),  # the whole watch's bound, more than 0: notify always waits (no --wait)
       ("--ssh-option", ("run",)),  # with --fleet: one ssh -o option (launch and ray: of every ssh)
       ("--by", ("report",))}  # the key: select ranks GPUs by it, report groups rows by it


def test_a_shared_flag_is_defined_once() -> None:
    seen: dict[str, tuple[tuple[str, ...], tuple[object, ...]]] = {}
    takers: dict[str, int] = {}
    for words in ALL:
        assert _parser(words).format_help()  # the flags copied from the parents fit their metavars
        for opt, a in _options(words).items():
            if opt not in SHARED or (opt, words) in OWN:
                continue
            takers[opt] = takers.get(opt, 0) + 1
            shape = (a.help, a.type, a.metavar, a.dest, a.nargs, a.choices, type(a))
            first = seen.setdefault(opt, (words, shape))
            assert shape == first[1], f"{opt}: {' '.join(words)} differs from {' '.join(first[0])}"
    assert takers["--interface"] >= 10 and takers["--session"] >= 10 and takers["--browse"] == 7, takers


def test_interface_is_the_same_flag_in_every_command_that_takes_it() -> None:
    found = {words: _options(words)["--interface"] for words in ALL if "--interface" in _options(words)}
    assert len({(a.help, a.type, a.metavar, a.dest, a.option_strings.__repr__()) for a in found.values()}) == 1
    assert {("start",), ("scan",), ("list",), ("top",), ("run",), ("reserve",), ("export", "prometheus-sd")} \
        <= set(found)


def test_a_word_is_a_switch_everywhere_or_nowhere() -> None:
    """``--wait`` was a switch in eight commands and seconds in three; ``--fleet`` a switch or a mode."""
    kinds: dict[str, dict[bool, list[str]]] = {}
    for words in ALL:
        for opt, a in _options(words).items():
            switch = a.nargs == 0
            kinds.setdefault(opt, {}).setdefault(switch, []).append(" ".join(words))
    mixed = {opt for opt, k in kinds.items() if len(k) > 1}
    # one subject, kept (docs/cli.md, "Vocabulary"): devices --topology shows how the GPUs connect, the
    # constraint --topology MODE chooses by it (issue 22's documented command stays)
    assert mixed == {"--topology"}


def test_help_groups_the_commands_as_the_docs_do() -> None:
    r = subprocess.run([sys.executable, "-m", "gpusd", "--help"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(SRC), COLUMNS="200"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    headings = [ln[3:] for ln in (ROOT / "docs" / "cli.md").read_text().splitlines() if ln.startswith("## ")]
    titles = [title for title, _ in GROUPS]
    assert titles == [h for h in headings if h in titles] and len(titles) == 9  # in the docs' order
    # each group's title, then its commands, one level deeper
    for title, cmds in GROUPS:
        at = lines.index(f"  {title}:")
        listed = []
        for ln in lines[at + 1:]:
            if not ln.startswith("    "):  # the next group's title, or the epilog
                break
            if ln[4] != " ":  # not a wrapped line of help
                listed.append(ln.split()[0])
        assert listed == [c for c, _ in cmds], title
    # gpisd, the seed name, too
    seed = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'gpisd'; from gpusd.cli import main; "
                           "sys.exit(main(['--help']))"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(SRC), COLUMNS="200"))
    assert seed.returncode == 0 and seed.stdout.startswith("usage: gpisd") and "  Local GPUs:" in seed.stdout


# Building one command's parser imports its own module of gpusd.cli (and the shared groups) only.
PROBE = """
import sys
from gpusd.cli import build_parser
build_parser(sys.argv[1])
print(" ".join(sorted(m for m in sys.modules if m.startswith("gpusd.cli"))))
"""


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in ("list_devices", "leases", "grow", "shrink",
                                                                      "status", "stop", "release")])
def test_a_command_builds_its_parser_from_its_own_module(command: str) -> None:
    from gpusd.cli import _MODULE

    r = subprocess.run([sys.executable, "-c", PROBE, command], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert r.returncode == 0, r.stderr
    mods = set(r.stdout.split())
    own = f"gpusd.cli.{_MODULE[command]}"
    others = {f"gpusd.cli.{m}" for m in _MODULE.values()} - {own}
    if command == "run":
        others.discard("gpusd.cli.jobs")  # the job flags of gpusd run (cli/jobs.py)
    assert own in mods and "gpusd.cli.options" in mods and sorted(mods & others) == []


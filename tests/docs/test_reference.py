"""docs/reference/ is generated from the code (megatron_branchnorm/commands/reference.py,
``python tools/gen_reference.py``): the checked-in pages equal what the code gives now, every
config key has a docstring, the table of environment variables matches what the package,
tools/ and slurm/ read, and no page is over 400 lines (the docs' limit): docs/reference/ holds
exactly the generated pages, each in the site's navigation."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_branchnorm.commands import FRONT_DOORS, reference
from megatron_branchnorm.formats.yaml_io import load_bounded

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "megatron_branchnorm" / "config.py"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return reference.build_pages()


def test_checked_in_pages_equal_the_generated_ones(pages):
    out = ROOT / reference.OUT_DIR
    stale = [
        name
        for name, text in pages.items()
        if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text
    ]
    assert stale == [], (
        f"docs/reference/ is out of date ({stale}): run python tools/gen_reference.py"
    )


def test_docs_reference_holds_no_page_the_generator_does_not_write(pages):
    extra = sorted(p.name for p in (ROOT / reference.OUT_DIR).iterdir() if p.name not in pages)
    assert extra == [], (
        f"docs/reference/ holds pages the generator does not write ({extra}): "
        "run python tools/gen_reference.py (it removes its own), move the others elsewhere"
    )


def test_every_page_is_at_most_400_lines_and_in_the_site_nav(pages):
    assert reference.MAX_LINES == 400
    long = {n: t.count("\n") for n, t in pages.items() if t.count("\n") > reference.MAX_LINES}
    assert long == {}
    nav = load_bounded((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), "mkdocs.yml")["nav"]
    section = next(entry["Reference"] for entry in nav if "Reference" in entry)

    def listed(entries):
        for entry in entries:
            values = entry.values() if isinstance(entry, dict) else [entry]
            for value in values:
                yield from listed(value) if isinstance(value, list) else [value]

    in_nav = sorted(Path(p).name for p in listed(section))
    assert in_nav == sorted(pages), "mkdocs.yml's Reference nav lists other pages than these"


def test_a_page_over_the_limit_fails_naming_it(monkeypatch):
    monkeypatch.setattr(reference, "commands_pages", dict)  # the slow part, not under test
    monkeypatch.setattr(reference, "exit_codes_page", lambda: "line\n" * 401)
    with pytest.raises(reference.ReferenceError, match=r"^docs/reference/exit-codes\.md .*401"):
        reference.build_pages()


def test_a_page_no_longer_generated_is_removed_and_no_other_file(tmp_path, monkeypatch, capsys):
    """``--check`` names a page the generator wrote and no longer writes; a run removes it;
    a file it did not write in docs/reference/ is refused, naming it, and kept."""
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    out = tmp_path / "docs" / "reference"
    out.mkdir(parents=True)
    (out / "index.md").write_text("new\n")
    old = out / "old.md"
    old.write_text(f"{reference.GENERATED}\n\n# Old\n")
    monkeypatch.setattr(reference, "build_pages", lambda root=None: {"index.md": "new\n"})
    assert reference.main(["--check"]) == 1
    assert "old.md (no longer generated)" in capsys.readouterr().err
    assert old.is_file()
    assert reference.main([]) == 0
    assert not old.exists() and (out / "index.md").read_text() == "new\n"
    assert reference.main(["--check"]) == 0
    mine = out / "notes.md"
    mine.write_text("# My notes\n")
    assert reference.main([]) == 2
    assert "notes.md not generated" in capsys.readouterr().err
    assert mine.read_text() == "# My notes\n"


def test_pages_hold_no_machine_path_nor_date(pages):
    for name, text in pages.items():
        assert str(ROOT) not in text, name
        assert str(Path.home()) not in text, name


def test_every_config_key_has_a_docstring():
    assert reference.undocumented_keys() == []


def test_a_key_without_a_docstring_fails_naming_it(tmp_path):
    source = CONFIG.read_text(encoding="utf-8")
    doc = '    hidden_size: int = 512\n    """Model width d."""\n'
    assert doc in source
    copy = tmp_path / "config.py"
    copy.write_text(source.replace(doc, "    hidden_size: int = 512\n"), encoding="utf-8")
    assert reference.undocumented_keys(copy) == ["model.hidden_size"]
    with pytest.raises(reference.ReferenceError, match=r"model\.hidden_size"):
        reference.config_keys(copy)


def test_config_page_reads_allowed_values_and_checks_from_validation():
    keys = {k.key: k for k in reference.config_keys()}
    assert set(keys["model.residual"].allowed) == {"branchnorm", "deepnorm", "postln", "preln"}
    assert keys["model.cuda_graphs"].allowed == ("off", "on", "auto")
    assert keys["train.best_metric"].allowed == ("valid_loss", "valid_bleu")
    assert "model.encoder_layers >= 1" in keys["model.encoder_layers"].checks
    assert "0.0 <= model.dropout < 1.0" in keys["model.dropout"].checks


def test_the_environment_table_matches_what_the_code_reads():
    assert reference.env_table_problems() == []


def test_env_scan_finds_every_way_of_reading_and_no_write(tmp_path):
    """The scanner on a small tree: each form of a read is found (a literal, a constant, an
    imported constant, a loop over a tuple, a helper taking the name, module level, a shell
    default or an unassigned use); a write and a copy for a child are not reads."""
    pkg = tmp_path / "megatron_branchnorm"
    pkg.mkdir()
    (pkg / "names.py").write_text('OTHER = "V_IMPORTED"\n')
    (pkg / "mod.py").write_text(
        textwrap.dedent(
            """
            import os
            from megatron_branchnorm.names import OTHER

            NAME = "V_CONST"
            PAIR = ("V_LOOP_A", "V_LOOP_B")
            TOP = os.environ.get("V_MODULE_LEVEL")


            def _int(name, low):
                return os.environ.get(name)


            def f(env=None):
                e = os.environ
                a = e.get("V_GET") or os.getenv("V_GETENV")
                b = os.environ["V_SUBSCRIPT"] if "V_IN" in os.environ else None
                os.environ["V_WRITTEN"] = "1"
                child = dict(os.environ, V_CHILD="1")
                c = all(n in os.environ for n in PAIR)
                d = (os.environ if env is None else env).get(NAME)
                return _int("V_HELPER", 0), os.environ.setdefault(OTHER, "x")
            """
        )
    )
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "common.sh").write_text(
        textwrap.dedent(
            """\
            # shellcheck shell=bash
            #   S_DOCUMENTED   what it means
            LOCAL_ONE=1
            echo "${S_DEFAULT:-x} $S_PLAIN $LOCAL_ONE $PWD"  # $S_IN_COMMENT
            read -r -a S_READ <<<"x"; echo "${S_READ[@]}"
            """
        )
    )
    reads = reference.env_reads(tmp_path)
    assert set(reads) == {
        "V_MODULE_LEVEL", "V_GET", "V_GETENV", "V_SUBSCRIPT", "V_IN", "V_LOOP_A", "V_LOOP_B",
        "V_CONST", "V_HELPER", "V_IMPORTED", "S_DEFAULT", "S_PLAIN",
    }  # fmt: skip
    assert reads["V_HELPER"] == {"megatron_branchnorm/mod.py (f)"}
    assert reads["V_MODULE_LEVEL"] == {"megatron_branchnorm/mod.py (module level)"}
    assert reference.shell_env_docs(tmp_path) == {"S_DOCUMENTED": "slurm/common.sh: what it means."}
    problems = reference.env_table_problems(tmp_path)
    assert "V_GET is read (megatron_branchnorm/mod.py (f)) and not described" in problems
    assert "S_DOCUMENTED is described and no longer read" in problems


def test_a_name_the_scan_cannot_tell_fails_naming_the_place(tmp_path):
    pkg = tmp_path / "megatron_branchnorm"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        "import os\n\n\ndef g(keys):\n    return [os.environ.get(k.upper()) for k in keys]\n"
    )
    with pytest.raises(reference.ReferenceError, match=r"megatron_branchnorm/mod\.py \(g\)"):
        reference.python_env_reads(tmp_path)


def test_help_does_not_depend_on_the_terminal(monkeypatch):
    door = next(d for d in FRONT_DOORS if d.name == "preprocess")
    texts = []
    for columns in ("40", "250"):
        monkeypatch.setenv("COLUMNS", columns)
        texts.append(reference._help_text(reference.door_parser(door)))
        assert os.environ["COLUMNS"] == columns  # the capture leaves the environment as it was
    assert texts[0] == texts[1]
    usage = texts[0].split("\n\n")[0].splitlines()  # argparse wraps the usage at COLUMNS
    assert len(usage) > 1 and max(len(line) for line in usage) <= reference.COLUMNS
    assert argparse.ArgumentParser.parse_known_args.__name__ == "parse_known_args"


def test_every_front_door_has_a_page_with_its_help_linked_from_the_commands_page(pages):
    for d in FRONT_DOORS:
        assert f"[{d.name}](commands-{d.name}.md)" in pages["commands.md"], d.name
        page = pages[f"commands-{d.name}.md"]
        assert page.startswith(f"{reference.GENERATED}\n\n# {d.name}\n"), d.name
        assert "\n```text\nusage: " in page, d.name


def test_config_pages_cover_every_key_and_every_shipped_config(pages):
    for k in reference.config_keys():
        section = k.key.split(".")[0]
        assert f"\n## {k.key}\n" in pages[f"config-{section}.md"], k.key
    for name, _summary, _sets in reference.shipped_configs():
        family = reference._shipped_family(name)
        assert f"\n## {name}\n" in pages[f"config-shipped-{family}.md"], name
        assert f"(config-shipped-{family}.md#{reference._slug(name)})" in pages["config-shipped.md"]


def test_check_mode_names_stale_pages(tmp_path, monkeypatch, capsys):
    """``--check`` changes nothing and exits 1 naming a page that differs."""
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    page = tmp_path / "docs" / "reference" / "index.md"
    page.write_text("placeholder\n")
    monkeypatch.setattr(reference, "build_pages", lambda root=None: {"index.md": "new\n"})
    assert reference.main(["--check"]) == 1
    assert "index.md" in capsys.readouterr().err
    assert page.read_text() == "placeholder\n"
    assert reference.main([]) == 0
    assert page.read_text() == "new\n"


def test_reading_the_trainers_parser_leaves_this_process_its_signals() -> None:
    """train.py installs a rank's stop handling when imported (a wakeup pipe and a watcher that
    ends the process with exit 75 on SIGTERM); the generator (and the docs' command checks in
    the test process) only read its parser, and keep SIGTERM's own handling."""
    code = (
        "import signal\n"
        "from megatron_branchnorm.commands import FRONT_DOORS\n"
        "from megatron_branchnorm.commands.reference import door_parser\n"
        "door_parser(next(d for d in FRONT_DOORS if d.name == 'train'))\n"
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.set_wakeup_fd(-1))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.stdout.split() == ["True", "-1"], out.stdout + out.stderr[-2000:]

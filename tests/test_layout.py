"""The package's layout rules (tests/support/layout_check.py), asserted: sizes, circles, floors, names.

Each rule is checked twice: on the package as it is, and on a planted breach in a throwaway copy,
so a checker that stopped finding anything would fail here too.
"""

from __future__ import annotations

import shutil

import pytest

from tests.support import layout_check


@pytest.fixture(scope="module")
def found():
    return layout_check.findings()


def test_no_module_above_the_line_limit(found):
    assert found["too long"] == []


def test_no_import_circle(found):
    assert found["import circles"] == []


def test_every_module_is_on_a_floor(found):
    assert found["modules on no floor"] == []


def test_no_module_imports_up_a_floor(found):
    assert found["imports up a floor"] == []


def test_formats_and_io_never_import_a_strategy(found):
    assert found["formats or io importing a strategy"] == []


def test_the_library_never_imports_the_cli(found):
    assert found["the library importing the CLI"] == []


def test_the_floors_keep_formats_and_io_below_the_strategies_and_the_cli_on_top():
    floors = [name for name, _prefixes in layout_check.FLOORS]
    assert floors.index("formats") < floors.index("io") < floors.index("strategy interfaces")
    assert floors[-1] == "cli"
    assert layout_check.floor_of("distckpt.strategies.zip_archive") == floors.index("strategies")
    assert layout_check.floor_of("distckpt.strategies.base") == floors.index("strategy interfaces")
    assert layout_check.floor_of("distckpt") == floors.index("around")


def test_no_private_name_crosses_a_module(found):
    assert found["private names imported"] == []


def test_the_checker_finds_planted_breaches(tmp_path, monkeypatch):
    package = tmp_path / "distckpt"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from distckpt.b import _hidden\n")
    (package / "b.py").write_text("def f():\n    from distckpt import a\n\n_hidden = 1\n")
    (package / "big.py").write_text("x = 1\n" * (layout_check.MAX_LINES + 1))
    monkeypatch.setattr(layout_check, "ROOT", tmp_path)
    monkeypatch.setattr(layout_check, "PACKAGE", package)
    planted = layout_check.findings()
    assert planted["too long"] == [
        f"distckpt/big.py: {layout_check.MAX_LINES + 1} lines (max {layout_check.MAX_LINES})"
    ]
    assert planted["import circles"] == ["distckpt.a -> distckpt.b"]
    assert planted["private names imported"] == ["distckpt/a.py:1: _hidden from distckpt.b"]
    assert planted["local imports"] == ["distckpt/b.py:2: distckpt.a"]
    shutil.rmtree(package)


def test_the_checker_finds_planted_floor_breaches(tmp_path, monkeypatch):
    package = tmp_path / "distckpt"
    for sub in ("formats", "io", "strategies", "cli"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "strategies" / "s.py").write_text("x = 1\n")
    (package / "cli" / "app.py").write_text("x = 1\n")
    (package / "formats" / "f.py").write_text("from distckpt.strategies.s import x\n")
    (package / "io" / "i.py").write_text("def f():\n    from distckpt.strategies import s\n")
    (package / "core.py").write_text("import distckpt.cli.app\n")
    (package / "cli" / "main.py").write_text("from distckpt.cli.app import x\n")
    (package / "newcomer.py").write_text("")
    monkeypatch.setattr(layout_check, "ROOT", tmp_path)
    monkeypatch.setattr(layout_check, "PACKAGE", package)
    planted = layout_check.findings()
    assert planted["modules on no floor"] == ["distckpt.newcomer"]
    assert planted["formats or io importing a strategy"] == [
        "distckpt/formats/f.py:1: distckpt.strategies.s",
        "distckpt/io/i.py:2: distckpt.strategies.s",
    ]
    assert planted["the library importing the CLI"] == ["distckpt/core.py:1: distckpt.cli.app"]
    assert planted["imports up a floor"] == [
        "distckpt/core.py:1: distckpt.cli.app (floor 'cli', above 'ground')",
        "distckpt/formats/f.py:1: distckpt.strategies.s (floor 'strategies', above 'formats')",
        "distckpt/io/i.py:2: distckpt.strategies.s (floor 'strategies', above 'io')",
    ]
    shutil.rmtree(package)

"""The package's layout rules (tests/support/layout_check.py), asserted: sizes, circles, private names.

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

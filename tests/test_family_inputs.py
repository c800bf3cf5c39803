"""Families' other flags (``Flags.inputs``): in the parser once per name, refused in one line
on a family that does not declare them, checked by the declaring family's ``check_inputs``."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import families
from engine.run.errors import UsageError


def _with_inputs(monkeypatch, key, inputs, check=None):
    """FAMILIES with family ``key`` declaring ``inputs`` (and ``check_inputs``)."""
    fam = families.FAMILIES[key]
    flags = dataclasses.replace(fam.flags, inputs=inputs, check_inputs=check)
    patched = {**families.FAMILIES, key: dataclasses.replace(fam, flags=flags)}
    monkeypatch.setattr(families, "FAMILIES", patched)
    monkeypatch.setattr(families, "INPUT_NAMES", tuple(inputs))
    return patched


def test_declared_input_reaches_parser_once_with_takers(monkeypatch):
    _with_inputs(monkeypatch, "wan", {"last_image": dict(metavar="PATH", help="last frame")})
    parser = argparse.ArgumentParser()
    families.add_input_flags(parser)
    assert parser.parse_args(["--last_image", "a.png"]).last_image == "a.png"
    assert parser.parse_args([]).last_image is None
    text = " ".join(parser.format_help().split())
    assert f"last frame ({families.FAMILIES['wan'].name} only)" in text


def test_other_family_refuses_in_one_line(monkeypatch):
    _with_inputs(monkeypatch, "wan", {"last_image": dict(metavar="PATH")})
    args = argparse.Namespace(last_image="a.png", model_id="x")
    with pytest.raises(UsageError) as e:
        families.resolve_inputs(args, "ltx2", {"frames": 9})
    assert str(e.value).startswith("--last_image")
    assert "\n" not in str(e.value)


def test_check_inputs_resolves_and_may_change_values(monkeypatch):
    def check(inputs, values, model_id):
        assert model_id == "m"
        return {**inputs, "seen": True}, {**values, "frames": 17}

    _with_inputs(monkeypatch, "wan", {"video": dict(metavar="PATH")}, check)
    args = argparse.Namespace(video="v.mp4", model_id="m")
    inputs, values = families.resolve_inputs(args, "wan", {"frames": 9})
    assert inputs == {"video": "v.mp4", "seen": True}
    assert values == {"frames": 17}


def test_family_without_inputs_gets_none(monkeypatch):
    _with_inputs(monkeypatch, "ltx2", {})  # LTX-2 declares --condition; here it declares none
    _with_inputs(monkeypatch, "wan", {"video": dict(metavar="PATH")})
    args = argparse.Namespace(video=None, model_id="m")
    assert families.resolve_inputs(args, "ltx2", {"frames": 9}) == (None, {"frames": 9})

"""The kvtier command line: help for every subcommand, clear errors for unknown flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.cli import build_parser, main


def _subcommands() -> list[list[str]]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    out = []
    for name, sub in action.choices.items():
        out.append([name])
        for inner in sub._actions:
            if getattr(inner, "choices", None) and inner.dest == "bench":
                out += [[name, n] for n in inner.choices]
    return out


@pytest.mark.parametrize("argv", _subcommands(), ids=" ".join)
def test_every_subcommand_has_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    assert "usage: kvtier" in capsys.readouterr().out


def test_unknown_flag_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["info", "--no-such-flag"])
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_bad_config_value_exits_2_with_message(capsys):
    assert main(["info", "--port", "99999"]) == 2
    assert "server.port" in capsys.readouterr().err


def test_info_json(capsys):
    assert main(["info", "--json", "--page-size", "32"]) == 0
    assert json.loads(capsys.readouterr().out)["cache"]["page_size"] == 32


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "kvtier", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("kvtier ")


def test_bench_keys_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "keys.json"
    assert main(["bench", "keys", "--tokens", "4096", "--page-sizes", "16,64", "--repeats", "2",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["page_size"] for r in report["runs"]] == [16, 64]
    assert report["runs"][0]["pages"] == 256 and "cpu" in report["machine"]

"""The `asyncmoe` command."""

from asyncmoe.cli import main


def test_demo_runs_and_matches_the_resident_model(capsys):
    assert main(["demo", "--tokens", "6", "--cache", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "same tokens as the resident model: True" in out
    assert "hit%" in out and "tokens/s" in out

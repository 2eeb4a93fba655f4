import pytest

from kvoffload.cli import SUBCOMMANDS, main


@pytest.mark.parametrize(
    "argv", [[name, "--help"] for name in SUBCOMMANDS] + [["events", "tail", "--help"], ["--help"]]
)
def test_every_help_renders(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "usage: kvoffload" in capsys.readouterr().out


def test_demo_rejects_non_positive_sizes():
    with pytest.raises(SystemExit, match="--turns must be positive, got 0"):
        main(["demo", "--turns", "0"])


def test_help_is_plain_text(capsys):
    """The top-level help says what the command does, without reST markup."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "offload the KV cache of LLM serving engines" in out
    assert "``" not in out

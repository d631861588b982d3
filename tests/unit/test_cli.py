"""The ``hotwire`` command's exit codes against a plain HTTP server (the real-server paths are in test_server.py)."""

import http.server
import json
import socket
import threading

import pytest

from hotwire_api import cli


class _WrongServer(http.server.BaseHTTPRequestHandler):
    """Answers 200 with JSON that is not a hotwire answer, as a different service on the port would."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def wrong_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WrongServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_answer_that_is_not_hotwires_is_the_servers_fault(wrong_server, capsys):
    assert cli.main(["--url", wrong_server, "slots"]) == 1
    err = capsys.readouterr().err
    assert "cannot read" in err and wrong_server in err


def test_an_unreachable_server_exits_1(capsys):
    assert cli.main(["--url", _closed_port_url(), "list"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_a_bad_local_file_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.safetensors"
    assert cli.main(["--url", "http://127.0.0.1:9", "register", "v", str(missing)]) == 2
    assert "nope.safetensors" in capsys.readouterr().err


def test_sae_folders_and_gguf_files_are_checked_before_anything_is_sent(tmp_path, capsys):
    url = "http://127.0.0.1:9"  # nothing is sent: each refusal is local (exit 2)
    folder = tmp_path / "sae"
    folder.mkdir()
    assert cli.main(["--url", url, "register", "v", str(folder)]) == 2
    assert "--feature" in capsys.readouterr().err
    (folder / "cfg.json").write_text(json.dumps({"d_in": 4, "d_sae": 2, "metadata": {"hook_name": "blocks.1.hook_resid_mid"}}))
    (folder / "sae_weights.safetensors").write_bytes(b"")
    assert cli.main(["--url", url, "register", "v", str(folder), "--feature", "0"]) == 2
    assert "hook_resid_mid" in capsys.readouterr().err
    assert cli.main(["--url", url, "register", "v", str(folder), "--feature", "0", "--layers", "1"]) == 2
    assert "--layers does not go with --feature" in capsys.readouterr().err
    gguf_file = tmp_path / "v.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert cli.main(["--url", url, "register", "v", str(gguf_file), "--layers", "1"]) == 2
    assert "names its layers" in capsys.readouterr().err


def _closed_port_url() -> str:
    """A URL on a local port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("value, layers", [("10,12", [10, 12]), ("[3, 4]", [3, 4]), ("7", [7])])
def test_layers_take_the_http_apis_syntax(value: str, layers: list[int]) -> None:
    assert cli._layers(value) == layers


@pytest.mark.parametrize("value, says", [("10,x", "layer indices like 10,12"), ("3,3", "lists a layer twice"),
                                          ("-1", "non-negative"), ("", "got nothing")])
def test_bad_layers_are_an_argument_error_saying_why(value: str, says: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=says):
        cli._layers(value)


def test_help_says_how_to_reach_another_server_and_pass_its_key(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal's width
    for words in ("--url", "HOTWIRE_URL", "http://localhost:8000", "--api-key", "HOTWIRE_API_KEY"):
        assert words in text, words


def test_the_url_and_key_come_from_the_environment_and_the_options_win(monkeypatch) -> None:
    monkeypatch.setenv("HOTWIRE_URL", "http://elsewhere:9000")
    monkeypatch.setenv("HOTWIRE_API_KEY", "from-env")
    args = cli.build_parser().parse_args(["slots"])
    assert (args.url, args.api_key) == ("http://elsewhere:9000", "from-env")
    args = cli.build_parser().parse_args(["slots", "--url", "http://given:1", "--api-key", "given"])
    assert (args.url, args.api_key) == ("http://given:1", "given")

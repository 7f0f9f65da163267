"""The console scripts' one exit rule (shared.cli_exit.run_command)."""

import subprocess
import sys

import pytest

from shared.cli_exit import listen_problem, run_command


class Bad(Exception):
    pass


class Failed(Exception):
    pass


@pytest.mark.parametrize("raised, status, said", [
    (Bad("no such file"), 2, "prog cmd: error: no such file"),
    (Failed("verification failed"), 1, "prog cmd: verification failed"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_exit_statuses(raised, status, said, capsys):
    def handler(_args):
        raise raised

    assert run_command("prog", "cmd", handler, None, (Bad,), (Failed,)) == status
    assert capsys.readouterr().err.strip() == said


def test_a_closed_stdout_ends_quietly_with_sigpipes_status():
    """``autoglm-partition inspect B | head -1``: the reader going away is not a traceback (exit 141, as a shell
    tool killed by SIGPIPE)."""
    code = ("import sys\n"
            "from shared.cli_exit import run_command\n"
            "def handler(_):\n"
            "    for i in range(200000):\n"
            "        print('line', i)\n"
            "    return 0\n"
            "sys.exit(run_command('prog', 'cmd', handler, None, ()))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()  # the reader goes away after one line
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err, err


@pytest.mark.parametrize("host, said", [
    ("caf\udce9", "--host is not UTF-8 text (byte 0xe9 after 'caf')"),  # argv's bytes, surrogateescape
    ("\ud800", "--host is not text (a lone surrogate U+D800"),  # a config file's escape
    ("a\x00b", "--host 'a\\x00b': a control or invisible character is in no host name or address"),
    ("\u200bhost", "--host '\\u200bhost': a control or invisible character"),  # pasted with the name
    ("\u00e9" * 70, ": cannot listen there (not a host name IDNA encodes)"),  # a label over 63 characters
])
def test_a_host_the_socket_cannot_take_is_a_one_line_problem(host, said):
    """Each was a TypeError traceback from the probe's bind (``autoglm-cloud serve``, ``autoglm-edge serve``, exit 1),
    where a host that does not resolve is a one-line usage error."""
    assert said in listen_problem(host, 8000)

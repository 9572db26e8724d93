"""``corral run-code``: run a snippet through run_code (the process substrate's call tier)."""

from __future__ import annotations

import sys

import typer

from corral.cli.output import EXIT_EXEC_ERROR, EXIT_TIMED_OUT, err, handled, print_json
from corral.runcode_models import DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT_S
from corral.sdk.run_code import run_code as sdk_run_code

app = typer.Typer()
EXIT_MEMORY = 137  # killed at its memory limit, as the shell reports a SIGKILL


@app.command("run-code")
@handled(EXIT_EXEC_ERROR)
def run_code(
    file: str = typer.Argument(None, metavar="[FILE]",
                               help="The program (- for stdin); or give it with -c."),
    code: str = typer.Option(None, "-c", "--code", help="The program text."),
    language: str = typer.Option("python", "--language", "-L", help="python or bash."),
    stdin: str = typer.Option(None, "--stdin", help="A file whose text goes to stdin."),
    timeout: float = typer.Option(DEFAULT_TIMEOUT_S, "--timeout", help="Seconds."),
    memory: int = typer.Option(DEFAULT_MEMORY_MB, "--memory", help="Memory limit in MiB."),
    json_: bool = typer.Option(False, "--json", help="The whole result as JSON."),
) -> None:
    """Run a python or bash snippet in a fresh locked-down process; exit with its code.

    Exit 125 means a corral error, 124 that it timed out.
    """
    if (file is None) == (code is None):
        err.print("corral run-code: give a FILE or -c CODE (one of them)")
        raise typer.Exit(2)
    if code is None:
        code = sys.stdin.read() if file == "-" else open(file, encoding="utf-8").read()
    text = None
    if stdin is not None:
        with open(stdin, encoding="utf-8") as f:
            text = f.read()
    res = sdk_run_code(code, language=language, stdin=text, timeout=timeout, memory_mb=memory)
    if json_:
        print_json(res)
    else:
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        sys.stdout.flush()
    if res.status == "timeout":
        err.print(f"corral: the program timed out after {timeout} s and was killed")
        raise typer.Exit(EXIT_TIMED_OUT)
    if res.status == "memory_exceeded":
        err.print(f"corral: the program was killed at its memory limit ({memory} MiB)")
        raise typer.Exit(EXIT_MEMORY)
    if res.status == "output_truncated":
        err.print("corral: the output was truncated")
    raise typer.Exit(res.exit_code)

"""``python -m corral.e2b serve ...``: the same as ``corral e2b serve``."""

from corral.cli.e2b import app

if __name__ == "__main__":
    app(prog_name="corral e2b")

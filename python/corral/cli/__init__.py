"""The ``corral`` command line; see corral.cli.main."""

"""The image tests' fixtures: corral.bench.ocifix (shared with ``corral bench images``)."""

from corral.bench.ocifix import *  # noqa: F403
from corral.bench.ocifix import BUSYBOX, Member  # noqa: F401 - named for the type checker

"""A task directory in Harbor's format (Terminal-Bench 2 uses it):

    task.toml        [agent] timeout_sec, [verifier] timeout_sec / env / user,
                     [environment] docker_image, cpus, memory_mb (or memory = "2G"),
                     storage_mb (or storage), build_timeout_sec
    instruction.md   what the agent is told
    environment/     Dockerfile (read by corral.sdk.dockerfile, built as a corral image) and
                     its build context; or none, with [environment] docker_image naming the
                     image
    tests/test.sh    the verifier: copied to /tests, run after the agent, it writes the reward
                     to /logs/verifier/reward.txt (a number) or reward.json (name -> number)
    solution/solve.sh  the reference solution the oracle agent runs (copied to /solution)

``load_tasks(path)`` takes one task directory or a directory of them.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import BuildFailed, InvalidRequest
from corral.sdk.build import Image
from corral.sdk.dockerfile import RUNTIME_ONLY, parse

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

def invalid(msg: str) -> InvalidRequest:
    return InvalidRequest(msg, code="invalid_task")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)


def _mb(value: Any, what: str) -> int:
    """``2048`` (MB) or ``"2G"`` / ``"512M"``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise invalid(f"task.toml: {what} {value!r} is not a size")
    scale = {"": 1 / 1024 / 1024, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    return max(1, int(float(m.group(1)) * scale[m.group(2).upper()]))


@dataclass(frozen=True)
class TaskDir:
    name: str
    path: Path
    instruction: str
    recipe: Image          # the environment: a corral image recipe, built cached per step
    agent_timeout: float = 600.0
    verifier_timeout: float = 600.0
    build_timeout: float = 600.0
    verifier_env: dict[str, str] = field(default_factory=dict)
    verifier_user: str | None = None
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int | None = None

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"

    def with_image(self, image: str) -> TaskDir:
        """The same task on another base image (``corral tasks run --image``)."""
        return TaskDir(**{**self.__dict__, "recipe": Image(image, self.recipe.steps)})


def load_task(path: Path) -> TaskDir:
    path = path.resolve()
    toml = path / "task.toml"
    try:
        conf = tomllib.loads(toml.read_text())
    except FileNotFoundError:
        raise invalid(f"{path} has no task.toml") from None
    except tomllib.TOMLDecodeError as e:
        raise invalid(f"{toml}: {e}") from None
    try:
        instruction = (path / "instruction.md").read_text()
    except FileNotFoundError:
        raise invalid(f"{path} has no instruction.md") from None
    if not (path / "tests" / "test.sh").is_file():
        raise invalid(f"{path} has no tests/test.sh")
    agent, verifier = conf.get("agent", {}), conf.get("verifier", {})
    env = conf.get("environment", {})
    dockerfile = path / "environment" / "Dockerfile"
    if dockerfile.is_file():
        try:  # what needs Docker itself is refused here, before anything is built
            recipe = parse(dockerfile.read_text(), str(path / "environment"),
                           ignore=RUNTIME_ONLY)
        except BuildFailed as e:
            raise invalid(f"{dockerfile}: {e.message}") from None
    elif env.get("docker_image"):
        recipe = Image(str(env["docker_image"]))
    else:
        raise invalid(f"{path}: neither environment/Dockerfile nor [environment] docker_image")
    name = conf.get("task", {}).get("name") or path.name
    try:
        return TaskDir(
            name=str(name), path=path, instruction=instruction, recipe=recipe,
            agent_timeout=float(agent.get("timeout_sec", 600.0)),
            verifier_timeout=float(verifier.get("timeout_sec", 600.0)),
            build_timeout=float(env.get("build_timeout_sec", 600.0)),
            verifier_env={str(k): str(v) for k, v in verifier.get("env", {}).items()},
            verifier_user=verifier.get("user"),
            cpus=float(env.get("cpus", 1)),
            memory_mb=_mb(env.get("memory_mb", env.get("memory", 2048)), "memory"),
            storage_mb=(_mb(env["storage_mb"] if "storage_mb" in env else env["storage"],
                            "storage") if ("storage_mb" in env or "storage" in env) else None),
        )
    except (TypeError, ValueError, AttributeError) as e:
        raise invalid(f"{toml}: {e}") from None


def load_tasks(path: str | Path) -> list[TaskDir]:
    """One task directory, or every task directory directly under ``path`` (sorted)."""
    p = Path(path)
    if not p.is_dir():
        raise invalid(f"{p} is not a directory")
    if (p / "task.toml").is_file():
        return [load_task(p)]
    tasks = [load_task(d) for d in sorted(p.iterdir()) if (d / "task.toml").is_file()]
    if not tasks:
        raise invalid(f"{p} holds no task directory (a directory with task.toml)")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise invalid(f"{p}: two tasks share a name")
    return tasks


__all__ = ["TaskDir", "invalid", "load_task", "load_tasks"]

"""``python -m corral.gym``: a scripted episode and a vectorised step, as a runnable example."""

from __future__ import annotations

import gymnasium

from corral.gym import ENV_ID

TASK = {
    "instruction": "make /work/done say ok",
    "setup": ["mkdir -p /work"],
    "score": '[ "$(cat /work/done 2>/dev/null)" = ok ] && echo 1 || echo 0',
    "cwd": "/work",
    "max_steps": 5,
}


def main() -> None:
    env = gymnasium.make(ENV_ID, task=TASK)
    try:
        obs, _ = env.reset(seed=0)
        print("instruction:", obs["output"])
        for action in ("ls -la", "echo ok > done"):
            obs, reward, terminated, truncated, info = env.step(action)
            print(f"$ {action} -> exit {obs['exit_code']}, reward {reward}, "
                  f"terminated {terminated}, infra {info['infra_error']}")
    finally:
        env.close()
    venv = gymnasium.make_vec(ENV_ID, num_envs=4, task=TASK)
    try:
        venv.reset(seed=0)
        _, rewards, terminated, _, _ = venv.step(
            ("true", "echo ok > done", "echo no > done", "echo ok > done"))
        print("vector rewards:", rewards.tolist(), "terminated:", terminated.tolist())
    finally:
        venv.close()


if __name__ == "__main__":
    main()

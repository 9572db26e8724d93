"""What every RL adapter shares (no trainer imported here).

task.py     a task: a start state (image, files, setup commands) and a scoring script
episode.py  an episode's sandbox: start on the task's snapshot, rewind, score, and failures
            sorted into the policy's own and the platform's (to mask)
skyrl.py    a SkyRL-gym text environment whose actions are tool calls (corral.tools)
trl.py      a TRL GRPOTrainer environment_factory environment
verl.py     verl BaseTool-contract tools, one sandbox per trajectory
"""

"""The agent process: torch's elastic agent fans out the ranks, and reports how they ended.

Started by the parent as `python -m runner.launch.agent`; it imports neither the
training code nor the models: ranks are separate processes (`python -m runner.train.worker`).
"""

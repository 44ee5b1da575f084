"""``kvtier demo``: a real (random-weight) model loading the contexts it has seen instead of
recomputing them, across a process restart; and a synthetic store round trip that needs no torch.

* :mod:`.workload` — the agent sessions replayed (texts with token budgets).
* :mod:`.worker` — one engine process: runs each request with and without kvtier.
* :mod:`.runner` — splits the scenario at restarts, spawns the workers, collects their records.
* :mod:`.limits` — host memcpy and raw disk read speeds, measured in the same run.
* :mod:`.summary` / :mod:`.report` — the figures, the tables, the plot.
* :mod:`.synthetic` — store → evict → reload of synthetic KV through host and disk tiers.
"""

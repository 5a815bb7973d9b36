"""The two-hosts rig: the lab's two guests as a real multi-host deployment (issue 13).

Host a runs PostgreSQL (postgres.py) and its `vrnic daemon` (agent.py); host b runs its own daemon under a
tiny control server (control.py) that host a drives: start, stop or kill -9 b's agent, run guest programs on
b. rig.py puts it together for the tests (tests/two_hosts), the bench and the demo; `python -m
vrnic.lab.two_hosts -- CMD` is the lab command both guests run (a runs CMD, b serves).
"""

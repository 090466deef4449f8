"""The vocabulary and the OS primitives every other package may use: errors, component states, a failure's
classification, atomic state files, journald/sd_notify protocols, child log files, the event bus, process trees
(spawn, adopt, stop), the agent's announcement for `nodeagentctl`. Imports nothing else of `nodeagent`.
"""

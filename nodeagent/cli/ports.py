"""`nodeagentctl ports`: the port lint of `nodeagent.portscmd`."""

from nodeagent.portscmd import cmd_ports

__all__ = ["cmd_ports"]

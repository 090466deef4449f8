"""Specific exceptions; the CLI and API turn them into one clear line or a JSON error."""


class AgentError(Exception):
    """Base of every error the agent reports to an operator."""


class ConfigError(AgentError):
    """The configuration is invalid; the message names the file, line and key path."""

    exit_code = 78  # EX_CONFIG: systemd's RestartPreventExitStatus=78 stops a restart loop


class LaunchError(AgentError):
    """A component could not be started (binary missing, launcher failed, PID not found)."""


class AdoptError(AgentError):
    """A recorded child cannot be adopted (gone, PID reused, cmdline differs)."""


class UnknownComponentError(AgentError):
    """An operator named a component the config does not have."""


class MissingPrerequisite(LaunchError):
    """The command, the model or a configured file is missing: no launch can succeed (a permanent failure)."""


class CoordinationUnavailable(AgentError):
    """A cluster action needs etcd, which does not answer now (the local stack is not disturbed)."""

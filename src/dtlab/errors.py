"""Errors that mean "the user's input is wrong": the CLI prints them as one line and exits 2."""


class DtlabError(Exception):
    """Bad input (config, files, combinations). Printed without a traceback, exit code 2."""

    exit_code = 2


class ConfigError(DtlabError):
    """The configuration is invalid. The message names the key and the fix."""


class DataError(DtlabError):
    """A dataset is missing, truncated, corrupt or fails its checksum."""


class PeerError(DtlabError):
    """This rank stops because another rank failed; that rank prints the cause."""


class RunError(DtlabError):
    """The run itself failed (a peer stopped, a non-finite loss): exit code 1, not bad input."""

    exit_code = 1

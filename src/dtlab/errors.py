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

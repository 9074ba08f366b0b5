"""User-facing errors: the CLI prints these as one line and exits nonzero (traceback with --debug)."""


class MtrainError(Exception):
    """A problem the user can fix (bad config, missing file, wrong shape). The message says what and how."""


class ConfigError(MtrainError, ValueError):
    """A recipe or override that does not validate; the message names the key."""

"""Errors a user can act on.

Anything raised as `KvlabError` reaches the command line as one line on stderr and exit code 2.
The message says what was wrong and what to do about it; no traceback unless `--debug`.
"""


class KvlabError(Exception):
    """Bad input or a missing resource: the message is shown to the user as is."""

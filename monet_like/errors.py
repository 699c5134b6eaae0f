"""The one exception type that means "the user asked for something we cannot do".

The command line turns it into a one-line message and exit code 2; anything
else that escapes is a bug in monet_like and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: an unknown model, a malformed shape, a bad budget..."""

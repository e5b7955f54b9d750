"""Error types the CLI turns into one line and an exit code.

Exit codes (shared by the CLI, the container and the Ansible train role):
0 pass, 1 the job ran but failed validation, 2 bad input, 3 the job does not fit this host.
"""

EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3


class BigmemError(Exception):
    """Base class: an error with a message a user can act on and an exit code."""

    exit_code = EXIT_BAD_INPUT


class BadInput(BigmemError):
    """Config, data, inventory or flags that cannot work (exit 2)."""

    exit_code = EXIT_BAD_INPUT


class DoesNotFit(BigmemError):
    """The planned job does not fit the memory of this host (exit 3)."""

    exit_code = EXIT_DOES_NOT_FIT

"""`python -m gramserve serve ...` is the same as the `gramserve` command."""

from gramserve.cli import main

main()

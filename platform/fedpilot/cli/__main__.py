"""`python -m fedpilot.cli`: the `fedpilot` command (how workers start a job's child process)."""

from fedpilot.cli import main

main()

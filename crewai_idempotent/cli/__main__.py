"""`python -m crewai_idempotent.cli`: the console script without its installed wrapper."""

from . import main

main(prog_name="crewai-idempotent")

"""`python -m serval.cli`, kept for scripts that start a server that way (bench/compare.py): the command itself
is serval/entrypoints/cli.py."""

from serval.entrypoints.cli import main

if __name__ == "__main__":
    main()

"""`python -m zerotrain ...`: the same as the `zerotrain` command."""

from zerotrain.cli.main import console_main

if __name__ == "__main__":
    console_main()

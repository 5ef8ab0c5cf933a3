"""`deepspeed.launcher.runner`: DeepSpeed's launcher module, running `zerotrain launch`."""

import sys

from zerotrain.launcher.job_environment import ENV_FILE_NAME as DEEPSPEED_ENVIRONMENT_NAME


def main(args=None) -> None:
    """`python -m deepspeed.launcher.runner ...` is `zerotrain launch ...`."""
    from zerotrain.cli.main import main as zerotrain_main

    sys.exit(zerotrain_main(["launch", *(sys.argv[1:] if args is None else args)]))


if __name__ == "__main__":
    main()
